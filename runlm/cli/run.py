"""``runlm run``: one streamed answer, or an interactive chat."""
from __future__ import annotations

import argparse
import sys
from typing import TextIO

from runlm.engine.sampling_params import SamplingParams, SamplingParamsError
from runlm.formats import ModelFormatError
from runlm.formats.chat_template import ChatTemplateError, render_chat
from runlm.formats.tokenizer import IncrementalDetokenizer
from runlm.store.builtin import DEFAULT_MODEL, UnknownModelError, resolve_model

_BYE = {"/bye", "/exit", "/quit"}


class Chat:
    """A conversation with one loaded model; keeps the history between turns."""

    def __init__(self, model_ref: str, params: SamplingParams, system: str | None) -> None:
        from runlm.engine.single import SingleStream
        from runlm.models.registry import load_decoder

        self.loaded = load_decoder(resolve_model(model_ref))
        self.stream = SingleStream(self.loaded)
        self.params = params
        self.history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []

    def reply(self, user_text: str, out: TextIO) -> str:
        """Stream the assistant's answer to ``out`` and return it."""
        tok = self.loaded.tokenizer
        self.history.append({"role": "user", "content": user_text})
        prompt = render_chat(self.history, tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
        ids = tok.encode(prompt, add_special_tokens=not _starts_with_bos(prompt, tok.bos_token))
        detok = IncrementalDetokenizer(tok, prompt_ids=ids, skip_special_tokens=True)
        for token in self.stream.generate(ids, self.params):
            out.write(detok.push(token))
            out.flush()
        out.write(detok.flush())
        out.flush()
        self.history.append({"role": "assistant", "content": detok.text})
        return detok.text


def _starts_with_bos(prompt: str, bos: str | None) -> bool:
    return bool(bos) and prompt.startswith(bos)


def _interactive(chat: Chat) -> None:
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
    try:
        chat = Chat(args.model or DEFAULT_MODEL, params, args.system)
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
