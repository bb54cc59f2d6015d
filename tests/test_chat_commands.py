"""`runlm run`'s interactive chat as Ollama users type into it, through a pty: /set, /show, /clear, /save,
/load, \"\"\" messages, --verbose; and the same commands on a daemon's chat; --format json and thinking."""
from __future__ import annotations

import json
import os
import pty
import subprocess
from pathlib import Path

import pytest

from runlm.cli.chat_commands import Commands, read_message
from runlm.cli.chat_turn import ChatOptions, Turn, TurnPrinter
from runlm.cli.run import Chat
from runlm.engine.types.sampling_params import SamplingParams
from tests.test_cli import ENV, HOME, RUNLM, _read_until


class _Pty:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([*RUNLM, "run", *args], stdin=slave, stdout=slave, stderr=slave,
                                     env=env or ENV, close_fds=True)
        os.close(slave)
        self.buf = bytearray()
        _read_until(self.master, b">>> ", 120, self.buf)

    def send(self, line: str, until: bytes = b">>> ", timeout: float = 120) -> str:
        """Type ``line``; what the chat printed up to its next prompt."""
        self.buf.clear()
        os.write(self.master, line.encode() + b"\n")
        _read_until(self.master, until, timeout, self.buf)
        return self.buf.decode(errors="replace").replace("\r\n", "\n")

    def close(self) -> int:
        os.write(self.master, b"/bye\n")
        try:
            return self.proc.wait(timeout=60)
        finally:
            self.proc.kill()
            os.close(self.master)


def test_ollamas_chat_commands_through_a_pty() -> None:
    chat = _Pty("tinycoder", "--max-tokens", "4", "--temperature", "0", "--verbose")
    try:
        assert "Set parameter 'temperature' to '0.1'" in chat.send("/set parameter temperature 0.1")
        assert "Unknown parameter 'bogus'" in chat.send("/set parameter bogus 1")
        assert "Couldn't set parameter" in chat.send("/set parameter top_p 7")
        assert "Set system message." in chat.send("/set system You are terse.")
        assert "You are terse." in chat.send("/show system")
        shown = chat.send("/show parameters")
        assert "temperature" in shown and "0.1" in shown
        assert "llama" in chat.send("/show info")
        # a message of several lines between triple quotes; the timings after the answer (--verbose)
        chat.buf.clear()
        os.write(chat.master, b'"""first line\n')
        _read_until(chat.master, b"... ", 30, chat.buf)
        answer = chat.send('second line"""')
        assert "eval count:           4 token(s)" in answer and "prompt eval rate:" in answer
        assert "Created new session 'talk'" in chat.send("/save talk")
        saved = json.loads((Path(HOME) / "sessions" / "talk.json").read_text())
        assert [m["role"] for m in saved["history"]] == ["system", "user", "assistant"]
        assert saved["history"][1]["content"] == "first line\nsecond line" and saved["parameters"] == {
            "temperature": 0.1}
        assert "Cleared session context" in chat.send("/clear")
        assert "Loaded session 'talk' (1 message(s))" in chat.send("/load talk")
        assert "No session 'nope'" in chat.send("/load nope")
        assert "Unknown command" in chat.send("/frobnicate")
        assert "/set parameter" in chat.send("/?")
    finally:
        assert chat.close() == 0


def test_commands_on_a_chat_object_and_multiline_reading() -> None:
    import io

    session = Chat("tinycoder", SamplingParams(temperature=0.0, max_tokens=3), system=None)
    out = io.StringIO()
    commands = Commands(session, lambda name: session, out)
    commands.run("/set parameter stop END HALT")
    commands.run("/set parameter num_predict 2")
    assert commands.session.params.stop == ["END", "HALT"] and commands.session.params.max_tokens == 2
    commands.run("/set parameter num_ctx 256")  # the model loaded again with that context, the chat kept
    assert session.engine.max_model_len == 256 and "Set parameter 'num_ctx' to '256'" in out.getvalue()
    commands.run("/set parameter num_ctx 100000")  # no more than the model's own (tinycoder: 2048)
    assert session.engine.max_model_len == 2048
    commands.run("/set parameter num_ctx many")
    assert "whole number" in out.getvalue()
    commands.run("/set format json")
    commands.run("/set nothink")
    assert session.options.format_json and session.options.think is False
    lines = iter(['"""a', "b", 'c"""'])
    assert read_message(lambda _: next(lines)) == "a\nb\nc"
    assert read_message(lambda _: '"""one line"""') == "one line"


def test_format_json_answers_json() -> None:
    import io

    session = Chat("smollm2", SamplingParams(temperature=0.0, max_tokens=40), system=None,
                   options=ChatOptions(format_json=True))
    text = session.reply("Give me a JSON object with the key 'city' for the capital of France.", io.StringIO())
    assert isinstance(json.loads(text), dict)
    assert session.last_turn is not None and session.last_turn.completion_tokens > 0


@pytest.mark.parametrize("hide", [False, True])
def test_thinking_is_framed_as_ollama_frames_it_or_hidden(hide: bool) -> None:
    import io

    out = io.StringIO()
    printer = TurnPrinter(out, Turn(), hide)
    printer.push("Let me think", "", 2)
    printer.push(" more.", "", 1)
    printer.push("", "The answer.", 2)
    turn = printer.finish(False)
    assert turn.thinking == "Let me think more." and turn.text == "The answer." and turn.completion_tokens == 5
    want = "The answer." if hide else "Thinking...\nLet me think more.\n...done thinking.\n\nThe answer."
    assert out.getvalue() == want
