"""`runlm run` as a user runs it: a real process, real models."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import tempfile
import time

import pytest

from runlm.cli.run import Chat
from runlm.engine.types.sampling_params import SamplingParams
from runlm.formats.modelfile import parse_modelfile

RUNLM = [sys.executable, "-m", "runlm.cli"]
# a store of their own: `run` stores the built-ins it uses, and no daemon of the user's is found
HOME = tempfile.mkdtemp(prefix="runlm-cli-test-")
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", RUNLM_HOME=HOME)
ENV.pop("RUNLM_HOST", None)


def runlm(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*RUNLM, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_smollm2_names_paris() -> None:
    res = runlm("run", "smollm2", "What is the capital of France?", "--temperature", "0", "--max-tokens", "40",
                "--exact-numerics")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_without_native_kernels_the_torch_fallback_still_answers() -> None:
    """A CPU without AVX2/FMA (or no compiler): no fast mode, no C++ kernels; torch computes the
    dequantized model, whose numerics are exact mode's."""
    res = subprocess.run([*RUNLM, "run", "smollm2", "What is the capital of France?", "--temperature", "0",
                          "--max-tokens", "20"], capture_output=True, text=True, timeout=300,
                         env={**ENV, "RUNLM_NO_KERNELS": "1"})
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout


def test_prompt_from_piped_stdin_and_options() -> None:
    res = runlm("run", "tinycoder", "--max-tokens", "8", "--seed", "7", "--top-k", "5", "--top-p", "0.9",
                "--system", "You write code.", stdin="def add(a, b):")
    assert res.returncode == 0, res.stderr
    again = runlm("run", "tinycoder", "--max-tokens", "8", "--seed", "7", "--top-k", "5", "--top-p", "0.9",
                  "--system", "You write code.", stdin="def add(a, b):")
    assert res.stdout == again.stdout and res.stdout.strip()  # seeded sampling is reproducible


def test_a_builtin_used_by_run_is_stored_for_show_ls_and_rm() -> None:
    runlm("rm", "tinycoder")  # whatever an earlier test left
    res = runlm("run", "tinycoder", "hi", "--max-tokens", "2")
    assert res.returncode == 0, res.stderr
    assert "storing the built-in model tinycoder" in res.stderr
    assert "tinycoder:latest" in runlm("ls").stdout
    show = runlm("show", "tinycoder")
    assert show.returncode == 0 and "gguf" in show.stdout.lower(), show.stdout + show.stderr
    again = runlm("run", "tinycoder", "hi", "--max-tokens", "2")
    assert again.returncode == 0 and "storing" not in again.stderr  # once
    assert runlm("rm", "tinycoder").returncode == 0 and "tinycoder" not in runlm("ls").stdout


def test_show_prints_the_sampling_parameters_the_model_recommends() -> None:
    assert runlm("pull", "smollm2").returncode == 0
    show = runlm("show", "smollm2")
    assert show.returncode == 0, show.stderr
    params = show.stdout.split("Parameters")[1].split("Template")[0].split()
    assert params == ["temperature", "0.0", "top_p", "0.9", "dry_multiplier", "0.8"]
    assert runlm("rm", "smollm2").returncode == 0


def test_unknown_model_lists_models_and_how_to_get_one() -> None:
    res = runlm("run", "no-such-model", "hi")
    assert res.returncode != 0
    assert "no-such-model" in res.stderr
    assert "smollm2" in res.stderr and "tinycoder" in res.stderr  # the models that exist
    assert ".gguf" in res.stderr  # and how to use one of your own


def test_embedding_model_is_refused_clearly() -> None:
    res = runlm("run", "minilm", "hi")
    assert res.returncode != 0
    assert "embedding model" in res.stderr
    assert "Traceback" not in res.stderr


def test_show_modelfile_is_ollamas() -> None:
    assert runlm("run", "smollm2", "hi", "--max-tokens", "1").returncode == 0  # (stores the built-in)
    res = runlm("show", "smollm2", "--modelfile")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "FROM smollm2:latest" in lines and "PARAMETER temperature 0.0" in lines
    mf = parse_modelfile(res.stdout)  # what `runlm create -f` reads back
    assert mf.template is not None and "<|im_start|>" in mf.template and mf.parameters["top_p"] == 0.9


def test_invalid_option_is_named() -> None:
    res = runlm("run", "tinycoder", "hi", "--top-p", "1.5")
    assert res.returncode == 2 and "top_p" in res.stderr


def _read_until(fd: int, marker: bytes, timeout: float, buf: bytearray) -> None:
    deadline = time.monotonic() + timeout
    while marker not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {marker!r} in {bytes(buf)[-500:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk


@pytest.mark.parametrize("quit_with", [b"/bye\n", b"\x04"])
def test_interactive_chat_keeps_history_and_quits(quit_with: bytes) -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen([*RUNLM, "run", "tinycoder", "--max-tokens", "5", "--temperature", "0"],
                            stdin=slave, stdout=slave, stderr=slave, env=ENV, close_fds=True)
    os.close(slave)
    buf = bytearray()
    try:
        _read_until(master, b">>> ", 120, buf)
        os.write(master, b"first question\n")
        buf.clear()
        _read_until(master, b">>> ", 120, buf)
        os.write(master, b"second question\n")
        buf.clear()  # (else the second prompt, still in buf, sends the quit while the answer streams)
        _read_until(master, b">>> ", 120, buf)
        os.write(master, quit_with)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)


def test_chat_history_is_sent_with_each_turn() -> None:
    import io

    chat = Chat("tinycoder", SamplingParams(temperature=0.0, max_tokens=3), system="Be terse.")
    chat.reply("first question", io.StringIO())
    chat.reply("second question", io.StringIO())
    assert [m["role"] for m in chat.history] == ["system", "user", "assistant", "user", "assistant"]
    # the second turn's prompt carries the whole conversation, and the first turn came from the prefix cache
    seen = chat.engine.tokenizer.decode(chat.llm.encode_chat(chat.history))
    assert "Be terse." in seen and "first question" in seen and "second question" in seen
    assert chat.engine.blocks.stats.hits > 0


@pytest.mark.parametrize("recipe", ["gemma3", "phi3", "qwen3-moe"])
def test_run_answers_from_a_gguf_file_of_each_new_family(recipe: str) -> None:
    """`runlm run ./model.gguf PROMPT --temperature 0` on generated models written by llama.cpp's converter: the
    answer is the engine's greedy answer to the same chat (random weights: the text itself means nothing)."""
    from runlm.engine.llm import LLM
    from tests.fixtures.gguf_convert import converted_gguf

    path = converted_gguf(recipe, "q8_0")
    res = runlm("run", str(path), "The capital of France is", "--temperature", "0", "--max-tokens", "12")
    assert res.returncode == 0, res.stderr
    llm = LLM(str(path), max_num_seqs=1, kv_cache_memory="64MiB")
    ids = llm.encode_chat([{"role": "user", "content": "The capital of France is"}])
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert len(out.token_ids) > 0 and res.stdout.strip() == out.text.strip()
