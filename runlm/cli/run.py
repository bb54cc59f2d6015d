"""``runlm run``: one streamed answer, or an interactive chat."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from runlm.catalog import BUILTIN_MODELS, DEFAULT_MODEL, UnknownModelError, resolve_model
from runlm.engine.core.detokenizer import DELTA
from runlm.engine.types.outputs import RequestOutput
from runlm.engine.types.sampling_params import SamplingParams, SamplingParamsError
from runlm.formats import ModelFormatError
from runlm.formats.chat_template import ChatTemplateError

if TYPE_CHECKING:
    from runlm.cli.client import Daemon
    from runlm.cli.run_daemon import DaemonChat

_BYE = {"/bye", "/exit", "/quit"}


# for a model that recommends no sampling settings of its own (a flag, then the model's, come first)
RUN_DEFAULTS: dict[str, float | int] = {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "max_tokens": 512}
_FLAGS = ("temperature", "top_p", "top_k", "max_tokens", "seed")


def local_model_path(ref: str) -> Path:
    return local_model(ref)[0]


def local_model(ref: str) -> tuple[Path, dict[str, float | int]]:
    """A model in the store by name, else a built-in name, a .gguf file or a model directory: its path and the
    sampling settings it recommends."""
    from runlm.catalog import recommended_sampling
    from runlm.store import InvalidNameError, ModelNotFoundError, ModelStore

    try:
        store = ModelStore()
        stored = store.get(ref)
        return store.model_path(stored), stored.info.sampling
    except InvalidNameError:
        path = resolve_model(ref)
        return path, recommended_sampling(ref, path)
    except ModelNotFoundError:
        if not _installed_builtin(ref):
            path = resolve_model(ref)
            return path, recommended_sampling(ref, path)
    # a built-in goes into the store on first use (as `ollama run` pulls), so show, ls and rm see it
    print(f"runlm: storing the built-in model {ref} (once)", file=sys.stderr)
    stored = store.pull(ref)
    return store.model_path(stored), stored.info.sampling


def read_images(paths: list[str]) -> list[bytes]:
    """The files --image names, each checked to be an image runlm can read (a ValueError says which is not)."""
    from runlm.models.vision.images import ImageError, open_image

    images = []
    for name in paths:
        try:
            data = Path(name).expanduser().read_bytes()
            open_image(data)
        except OSError as exc:
            raise ValueError(f"--image {name}: {exc.strerror or exc}") from None
        except ImageError as exc:
            raise ValueError(f"--image {name}: {exc}") from None
        images.append(data)
    return images


def user_message(text: str, images: list[Any]) -> dict[str, Any]:
    """A user turn: the images first (each ``{"type": "image", "image": bytes}``), then the text."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [*({"type": "image", "image": i} for i in images),
                                        {"type": "text", "text": text}]}


def run_params(flags: dict[str, float | int], recommended: dict[str, float | int]) -> SamplingParams:
    """The flags given, over the model's recommended settings, over RUN_DEFAULTS (raises SamplingParamsError)."""
    return SamplingParams(**{**RUN_DEFAULTS, **recommended, **flags})  # type: ignore[arg-type]


def _installed_builtin(ref: str) -> bool:
    return ref in BUILTIN_MODELS and BUILTIN_MODELS[ref].path() is not None


def _stored_on_daemon(daemon: Daemon, ref: str) -> None:
    """The daemon's store gets a built-in the same way, through its own pull."""
    if _installed_builtin(ref) and daemon.http.get(f"/models/{ref}").status_code == 404:
        print(f"runlm: storing the built-in model {ref} (once)", file=sys.stderr)
        for event in daemon.stream("/models/create", {"from": ref}):
            if event.get("error"):
                raise UnknownModelError(f"storing {ref} failed: {event['error']}")


def _recommended_on_daemon(daemon: Daemon, ref: str) -> dict[str, float | int]:
    """The sampling settings the daemon's store knows the model recommends ({} for a model it has not stored)."""
    resp = daemon.http.get(f"/models/{ref}")
    return (resp.json().get("config") or {}).get("sampling") or {} if resp.status_code == 200 else {}


class Chat:
    """A conversation with one model loaded in this process; keeps the history between turns."""

    def __init__(self, model_ref: str, params: SamplingParams, system: str | None, exact_numerics: bool = False,
                 threads: int | None = None, path: Path | None = None) -> None:
        from runlm.engine.factory import engine_config, engine_from_config
        from runlm.engine.llm import LLM

        # one conversation at a time; the prefix cache keeps earlier turns, so each turn computes only itself
        config = engine_config(path or local_model_path(model_ref), max_num_seqs=1, exact_numerics=exact_numerics,
                               threads=threads)
        self.llm = LLM(engine=engine_from_config(config))
        self.name = model_ref
        self.engine = self.llm.engine
        self.params = params
        self.history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self._turn = 0

    def reply(self, user_text: str, out: TextIO, images: list[bytes] | None = None) -> str:
        """Stream the assistant's answer to ``out`` and return it. ``images`` (encoded) come with this turn and
        stay in the conversation (the encoder and prefix caches keep later turns from computing them again)."""
        from runlm.formats.chat_images import take_images

        if images and "image" not in self.engine.modalities:
            raise ValueError(f"the model {self.name} does not accept images (it is a text-only model)")
        self.history.append(user_message(user_text, images or []))
        messages, pictures = take_images(self.history)
        ids = self.llm.encode_chat(messages)
        self._turn += 1
        rid = f"turn-{self._turn}"
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if pictures:
            prompt["multi_modal_data"] = {"image": pictures}
        try:
            self.engine.add_request(rid, prompt, replace(self.params), output_kind=DELTA)
        except Exception:
            self.history.pop()
            raise
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


def _interactive(chat: Chat | DaemonChat, images: list[bytes]) -> None:
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
            chat.reply(line, sys.stdout, images)
            images = []  # (the first message brings them; they stay in the conversation)
        except KeyboardInterrupt:  # stop this answer, keep the chat
            chat.history.pop()
        print("\n")


def run_command(args: argparse.Namespace) -> int:
    flags = {name: value for name in _FLAGS if (value := getattr(args, name)) is not None}
    try:
        run_params(flags, {})  # a bad flag is refused before any model loads
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
        images = read_images(args.image)
    except ValueError as exc:
        print(f"runlm run: {exc}", file=sys.stderr)
        return 2
    from runlm.cli.client import connect
    from runlm.cli.run_daemon import DaemonChat

    daemon = connect()
    try:
        ref = args.model or DEFAULT_MODEL
        if daemon is not None:  # the daemon has the model loaded already, or loads it once for everyone
            _stored_on_daemon(daemon, ref)
            params = run_params(flags, _recommended_on_daemon(daemon, ref))
            chat: Chat | DaemonChat = DaemonChat(daemon, ref, params, args.system)
        else:
            path, recommended = local_model(ref)
            chat = Chat(ref, run_params(flags, recommended), args.system, args.exact_numerics, args.threads, path)
    except (UnknownModelError, SamplingParamsError) as exc:
        print(f"runlm run: {exc}", file=sys.stderr)
        return 1
    except ModelFormatError as exc:
        print(f"runlm run: {exc}", file=sys.stderr)
        return 1
    try:
        if prompt:
            chat.reply(prompt, sys.stdout, images)
            print()
        else:
            _interactive(chat, images)
    except (ChatTemplateError, ValueError) as exc:
        print(f"\nrunlm run: {exc}", file=sys.stderr)
        return 1
    return 0
