"""The interactive chat of ``runlm run``, with Ollama's commands: ``/set parameter NAME VALUE``, ``/set system``,
``/set verbose|quiet``, ``/set format json|noformat``, ``/set think|nothink|hidethinking|nohidethinking``,
``/show info|parameters|template|system``, ``/clear``, ``/save NAME``, ``/load NAME``, ``/?``, ``/bye``, and
``\"\"\"`` to start and end a message of several lines.

``/save`` writes the conversation, system message, parameters and options to ``$RUNLM_HOME/sessions/NAME.json``;
``/load`` takes them back (the model named in the file, loaded again where it is not the one running).
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol, TextIO

from runlm.cli.chat_turn import ChatOptions
from runlm.engine.types.sampling_params import SamplingParams, SamplingParamsError

BYE = {"/bye", "/exit", "/quit"}
MULTILINE = '"""'
_SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Ollama's parameter names -> SamplingParams fields (what /set parameter takes)
PARAMETERS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
              "num_predict": "max_tokens", "repeat_penalty": "repetition_penalty", "repeat_last_n": "penalty_last_n",
              "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
              "typical_p": "typical_p", "mirostat": "mirostat", "mirostat_tau": "mirostat_tau",
              "mirostat_eta": "mirostat_eta", "stop": "stop"}
_INTS = {"top_k", "seed", "max_tokens", "penalty_last_n", "mirostat"}
HELP = """Available commands:
  /set parameter NAME VALUE   set a sampling parameter (temperature, top_p, top_k, min_p, seed, num_predict,
                              repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, typical_p,
                              mirostat, mirostat_tau, mirostat_eta, stop) or the context length (num_ctx)
  /set system TEXT            set the system message
  /set verbose | quiet        show (or not) the timings after each answer
  /set format json | noformat answer in JSON (or freely)
  /set think | nothink        turn a reasoning model's thinking on or off
  /set hidethinking | nohidethinking
  /show info | parameters | template | system
  /clear                      forget the conversation
  /save NAME | /load NAME     keep the conversation in a session file, and take it back
  /bye                        quit
Use \"\"\" to begin and end a message of several lines."""


class Session(Protocol):
    params: SamplingParams
    options: ChatOptions
    history: list[dict[str, Any]]

    @property
    def name(self) -> str: ...

    @property
    def template(self) -> str | None: ...

    def info(self) -> dict[str, Any]: ...

    def set_context(self, tokens: int) -> int:
        """Run the model with a context of ``tokens`` (at most its own); returns the context it has now."""
        ...

    def reply(self, user_text: str, out: TextIO, images: list[bytes] | None = None) -> str: ...


class Quit(Exception):
    pass


def sessions_dir() -> Path:
    from runlm.store import default_home

    return default_home() / "sessions"


def _value(field: str, text: str) -> Any:
    if field == "stop":
        return text.split()
    return int(text) if field in _INTS else float(text)


class Commands:
    """One chat's command interpreter; ``open_model(name)`` starts a chat with another model (for /load)."""

    def __init__(self, session: Session, open_model: Callable[[str], Session], out: TextIO = sys.stdout) -> None:
        self.session, self.open_model, self.out = session, open_model, out
        self.changed: dict[str, Any] = {}  # the parameters set in this chat (what /show parameters lists)

    def say(self, text: str) -> None:
        print(text, file=self.out)

    def run(self, line: str) -> None:
        """Carry out ``line`` (a /command); raises Quit for /bye."""
        words = line.split(maxsplit=2)
        cmd = words[0]
        if cmd in BYE:
            raise Quit
        if cmd in ("/?", "/help"):
            self.say(HELP)
        elif cmd == "/set" and len(words) > 1:
            self._set(words[1], words[2] if len(words) > 2 else "")
        elif cmd == "/show" and len(words) > 1:
            self._show(words[1])
        elif cmd == "/clear":
            self.session.history[:] = [m for m in self.session.history if m["role"] == "system"]
            self.say("Cleared session context")
        elif cmd in ("/save", "/load") and len(words) == 2:
            self._save(words[1]) if cmd == "/save" else self._load(words[1])
        else:
            self.say(f"Unknown command '{line.strip()}'. Type /? for help")

    def _set(self, what: str, rest: str) -> None:
        s = self.session
        flags = {"verbose": ("verbose", True), "quiet": ("verbose", False), "think": ("think", True),
                 "nothink": ("think", False), "hidethinking": ("hide_thinking", True),
                 "nohidethinking": ("hide_thinking", False), "noformat": ("format_json", False)}
        if what == "parameter":
            self._set_parameter(rest)
        elif what == "system":
            if not rest:
                self.say("Usage: /set system TEXT")
                return
            s.history[:] = [{"role": "system", "content": rest}] + [m for m in s.history if m["role"] != "system"]
            self.say("Set system message.")
        elif what == "format" and rest.strip() == "json":
            s.options.format_json = True
            self.say("Set format to 'json' mode.")
        elif what in flags:
            name, value = flags[what]
            setattr(s.options, name, value)
            self.say(f"Set '{what}' mode.")
        else:
            self.say(f"Unknown /set '{what}'. Type /? for help")

    def _set_parameter(self, rest: str) -> None:
        parts = rest.split(maxsplit=1)
        if len(parts) != 2:
            self.say("Usage: /set parameter NAME VALUE")
            return
        name, text = parts
        if name == "num_ctx":
            if not text.isdigit() or int(text) < 16:
                self.say("num_ctx must be a whole number of tokens, at least 16")
                return
            try:
                got = self.session.set_context(int(text))
            except (ValueError, OSError) as exc:
                self.say(f"Couldn't set num_ctx: {exc}")
                return
            self.changed[name] = got
            self.say(f"Set parameter 'num_ctx' to '{got}'")
            return
        field = PARAMETERS.get(name)
        if field is None:
            self.say(f"Unknown parameter '{name}' (one of: {', '.join(PARAMETERS)})")
            return
        try:
            value = _value(field, text)
            self.session.params = replace(self.session.params, **{field: value})
            self.session.params.validate()
        except (ValueError, SamplingParamsError) as exc:
            self.say(f"Couldn't set parameter: {exc}")
            return
        self.changed[name] = value
        self.say(f"Set parameter '{name}' to '{text}'")

    def _show(self, what: str) -> None:
        s = self.session
        if what == "info":
            self.say(f"  Model\n    {'name':<20}{s.name}")
            for key, value in s.info().items():
                self.say(f"    {key:<20}{value if value not in (None, '') else '-'}")
        elif what == "parameters":
            p = s.params
            shown = {n: getattr(p, f) for n, f in PARAMETERS.items() if n in self.changed or f in (
                "temperature", "top_p", "top_k", "max_tokens")}
            self.say("\n".join(f"{n:<30}{v}" for n, v in shown.items()))
        elif what == "template":
            self.say(s.template or "No template was specified for this model (ChatML is used).")
        elif what == "system":
            system = next((m["content"] for m in s.history if m["role"] == "system"), None)
            self.say(system or "No system message was specified for this model.")
        else:
            self.say(f"Unknown /show '{what}'. Type /? for help")

    def _path(self, name: str) -> Path | None:
        if not _SESSION_NAME.fullmatch(name):
            self.say("A session name is letters, digits, '.', '_' and '-' (up to 64)")
            return None
        return sessions_dir() / f"{name}.json"

    def _save(self, name: str) -> None:
        path = self._path(name)
        if path is None:
            return
        s = self.session
        text_only = [m for m in s.history if isinstance(m.get("content"), str)]  # (images are not kept)
        data = {"model": s.name, "history": text_only, "parameters": self.changed, "options": asdict(s.options)}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        self.say(f"Created new session '{name}'")

    def _load(self, name: str) -> None:
        path = self._path(name)
        if path is None:
            return
        try:
            data = json.loads(path.read_text())
            history = [m for m in data["history"] if m.get("role") in ("system", "user", "assistant")
                       and isinstance(m.get("content"), str)]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.say(f"No session '{name}' (see /save)")
            return
        if data.get("model") and data["model"] != self.session.name:
            self.say(f"Loading model '{data['model']}'")
            self.session = self.open_model(data["model"])
        self.session.history[:] = history
        for key, value in (data.get("options") or {}).items():
            if hasattr(self.session.options, key):
                setattr(self.session.options, key, value)
        for key, value in (data.get("parameters") or {}).items():
            self._set_parameter(f"{key} {' '.join(value) if isinstance(value, list) else value}")
        self.say(f"Loaded session '{name}' ({sum(m['role'] == 'user' for m in history)} message(s))")


def read_message(prompt: Callable[[str], str]) -> str:
    """One message: a line, or the lines between \"\"\" and \"\"\"."""
    line = prompt(">>> ")
    if not line.lstrip().startswith(MULTILINE):
        return line
    text = line.lstrip()[len(MULTILINE):]
    lines = []
    while True:
        if text.rstrip().endswith(MULTILINE):
            lines.append(text.rstrip()[:-len(MULTILINE)])
            return "\n".join(lines).strip("\n")
        lines.append(text)
        text = prompt("... ")


def interactive(session: Session, images: list[bytes], open_model: Callable[[str], Session]) -> None:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print("Type a message; /? for help, /bye or Ctrl-D quits.", file=sys.stderr)
    commands = Commands(session, open_model)
    while True:
        try:
            line = read_message(input)
        except EOFError:
            print()
            return
        if not line.strip():
            continue
        if line.startswith("/") and not line.startswith("//"):
            try:
                commands.run(line)
            except Quit:
                return
            continue
        try:
            commands.session.reply(line, sys.stdout, images)
            images = []  # (the first message brings them; they stay in the conversation)
        except KeyboardInterrupt:  # stop this answer, keep the chat
            commands.session.history.pop()
        print("\n")
