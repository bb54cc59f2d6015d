"""``runlm run``: one streamed answer, or an interactive chat."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from runlm.engine.detokenizer import DELTA
from runlm.engine.outputs import RequestOutput
from runlm.engine.sampling_params import SamplingParams, SamplingParamsError
from runlm.formats import ModelFormatError
from runlm.formats.chat_template import ChatTemplateError
from runlm.store.builtin import BUILTIN_MODELS, DEFAULT_MODEL, UnknownModelError, resolve_model

if TYPE_CHECKING:
    from runlm.cli.client import Daemon
    from runlm.cli.run_daemon import DaemonChat

_BYE = {"/bye", "/exit", "/quit"}


def local_model_path(ref: str) -> Path:
    """A model in the store by name, else a built-in name, a .gguf file or a model directory."""
    from runlm.store import InvalidNameError, ModelNotFoundError, ModelStore

    try:
        store = ModelStore()
        return store.model_path(store.get(ref))
    except InvalidNameError:
        return resolve_model(ref)
    except ModelNotFoundError:
        if not _installed_builtin(ref):
            return resolve_model(ref)
    # a built-in goes into the store on first use (as `ollama run` pulls), so show, ls and rm see it
    print(f"runlm: storing the built-in model {ref} (once)", file=sys.stderr)
    return store.model_path(store.pull(ref))


def _installed_builtin(ref: str) -> bool:
    return ref in BUILTIN_MODELS and BUILTIN_MODELS[ref].path() is not None


def _stored_on_daemon(daemon: Daemon, ref: str) -> None:
    """The daemon's store gets a built-in the same way, through its own pull."""
    if _installed_builtin(ref) and daemon.http.get(f"/models/{ref}").status_code == 404:
        print(f"runlm: storing the built-in model {ref} (once)", file=sys.stderr)
        for event in daemon.stream("/models/create", {"from": ref}):
            if event.get("error"):
                raise UnknownModelError(f"storing {ref} failed: {event['error']}")


class Chat:
    """A conversation with one model loaded in this process; keeps the history between turns."""

    def __init__(self, model_ref: str, params: SamplingParams, system: str | None, exact_numerics: bool = False,
                 threads: int | None = None) -> None:
        from runlm.engine.factory import engine_config, engine_from_config
        from runlm.engine.llm import LLM

        # one conversation at a time; the prefix cache keeps earlier turns, so each turn computes only itself
        config = engine_config(local_model_path(model_ref), max_num_seqs=1, exact_numerics=exact_numerics,
                               threads=threads)
        self.llm = LLM(engine=engine_from_config(config))
        self.engine = self.llm.engine
        self.params = params
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self._turn = 0

    def reply(self, user_text: str, out: TextIO) -> str:
        """Stream the assistant's answer to ``out`` and return it."""
        self.history.append({"role": "user", "content": user_text})
        ids = self.llm.encode_chat(self.history)
        self._turn += 1
        rid = f"turn-{self._turn}"
        self.engine.add_request(rid, {"prompt_token_ids": ids}, replace(self.params), output_kind=DELTA)
        text = []
        try:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    assert isinstance(o, RequestOutput)  # add_request refused anything but generation
                    text.append(o.outputs[0].text)
                    out.write(o.outputs[0].text)
                    out.flush()
        except KeyboardInterrupt:
            self.engine.abort_request(rid)
            raise
        self.history.append({"role": "assistant", "content": "".join(text)})
        return "".join(text)


def _interactive(chat: Chat | DaemonChat) -> None:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print("Type a message; /bye or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return
        if line.strip() in _BYE:
            return
        if not line.strip():
            continue
        try:
            chat.reply(line, sys.stdout)
        except KeyboardInterrupt:  # stop this answer, keep the chat
            chat.history.pop()
        print("\n")


def run_command(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
    except SamplingParamsError as exc:
        print(f"runlm run: {exc}", file=sys.stderr)
        return 2
    prompt = " ".join(args.prompt)
    if not prompt and not sys.stdin.isatty():
        prompt = sys.stdin.read().strip()
        if not prompt:
            print("runlm run: the prompt on stdin is empty", file=sys.stderr)
            return 2
    from runlm.cli.client import connect
    from runlm.cli.run_daemon import DaemonChat

    daemon = connect()
    try:
        if daemon is not None:  # the daemon has the model loaded already, or loads it once for everyone
            _stored_on_daemon(daemon, args.model or DEFAULT_MODEL)
            chat: Chat | DaemonChat = DaemonChat(daemon, args.model or DEFAULT_MODEL, params, args.system)
        else:
            chat = Chat(args.model or DEFAULT_MODEL, params, args.system, args.exact_numerics, args.threads)
    except UnknownModelError as exc:
        print(f"runlm run: {exc}", file=sys.stderr)
        return 1
    except ModelFormatError as exc:
        print(f"runlm run: {exc}", file=sys.stderr)
        return 1
    try:
        if prompt:
            chat.reply(prompt, sys.stdout)
            print()
        else:
            _interactive(chat)
    except (ChatTemplateError, ValueError) as exc:
        print(f"\nrunlm run: {exc}", file=sys.stderr)
        return 1
    return 0
