"""``runlm run``: one streamed answer, or an interactive chat."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

from runlm.catalog import BUILTIN_MODELS, DEFAULT_MODEL, UnknownModelError, resolve_model
from runlm.cli.chat_turn import ChatOptions, Turn, TurnPrinter
from runlm.engine.core.detokenizer import DELTA
from runlm.engine.types.outputs import RequestOutput
from runlm.engine.types.sampling_params import SamplingParams, SamplingParamsError
from runlm.formats import ModelFormatError
from runlm.formats.chat_template import ChatTemplateError
from runlm.formats.modelfile import ChatDefaults

if TYPE_CHECKING:
    from runlm.cli.client import Daemon
    from runlm.cli.run_daemon import DaemonChat

# for a model that recommends no sampling settings of its own (a flag, then the model's, come first)
RUN_DEFAULTS: dict[str, float | int] = {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "max_tokens": 512}
_FLAGS = ("temperature", "top_p", "top_k", "max_tokens", "seed")


def local_model_path(ref: str) -> Path:
    return local_model(ref).path


class LocalModel(NamedTuple):
    path: Path
    sampling: dict[str, float | int]                 # the settings it recommends
    template: str | None = None                      # a Modelfile's TEMPLATE
    chat_defaults: ChatDefaults | None = None        # a Modelfile's SYSTEM, MESSAGE and stop lines
    adapter: Path | None = None                      # a Modelfile's ADAPTER (a PEFT folder or a .gguf file)


def local_model(ref: str) -> LocalModel:
    """A model in the store by name, else a built-in name, a .gguf file or a model directory: its path, the
    sampling settings it recommends and, for a model made from a Modelfile, its template and chat defaults."""
    from runlm.catalog import recommended_sampling
    from runlm.store import InvalidNameError, ModelNotFoundError, ModelStore
    from runlm.store.modelfile_model import chat_settings

    try:
        store = ModelStore()
        stored = store.get(ref)
    except InvalidNameError:
        path = resolve_model(ref)
        return LocalModel(path, recommended_sampling(ref, path))
    except ModelNotFoundError:
        from runlm.store.sources import hub_repo

        hub = hub_repo(ref) is not None and not Path(ref).expanduser().exists()
        if not _installed_builtin(ref) and not hub:
            path = resolve_model(ref)
            return LocalModel(path, recommended_sampling(ref, path))
        # a built-in or a Hugging Face repo goes into the store on first use (as `ollama run` pulls), so show, ls
        # and rm see it (a repo from the hub, or from the local Hugging Face cache when offline)
        print(f"runlm: storing the {'model ' + ref if hub else 'built-in model ' + ref} (once)", file=sys.stderr)
        stored = store.pull(ref, name=ref if hub else None)  # (a repo by its id: the next run finds it)
    path = store.model_path(stored)
    return LocalModel(path, stored.info.sampling, *chat_settings(stored, path))


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
                 threads: int | None = None, model: LocalModel | None = None,
                 options: ChatOptions | None = None) -> None:
        from runlm.engine.types.lora_request import LoRARequest
        from runlm.runner.backends.native import LORA_RANK

        # one conversation at a time; the prefix cache keeps earlier turns, so each turn computes only itself
        model = model or local_model(model_ref)
        lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": LORA_RANK} if model.adapter else {}
        self._engine_args = dict(max_num_seqs=1, exact_numerics=exact_numerics, threads=threads, **lora)
        self.lora = LoRARequest(model_ref, 1, str(model.adapter)) if model.adapter else None
        self.model = model
        self.name = model_ref
        self._load()
        if model.chat_defaults is not None and model.chat_defaults.stop and not params.stop:
            params = replace(params, stop=list(model.chat_defaults.stop))
        self.params = params
        self.options = options or ChatOptions()
        self.history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self.last_turn: Turn | None = None
        self._turn = 0

    @property
    def path(self) -> Path:
        return self.model.path

    def _load(self, **extra: Any) -> None:
        from runlm.engine.factory import engine_config, engine_from_config
        from runlm.engine.llm import LLM

        config = engine_config(self.path, **self._engine_args, **extra)
        self.llm = LLM(engine=engine_from_config(config))
        self.engine = self.llm.engine
        if self.model.template is not None:
            self.engine.tokenizer.chat_template = self.model.template
        self.engine.tokenizer.chat_defaults = self.model.chat_defaults

    def set_context(self, tokens: int) -> int:
        """The model loaded again with a context of ``tokens`` (its own at most), the conversation kept."""
        from runlm.store.inspect import inspect_model

        tokens = min(tokens, inspect_model(self.path).context_length or tokens)
        self._load(max_model_len=tokens)
        return self.engine.max_model_len

    @property
    def template(self) -> str | None:
        return self.engine.tokenizer.chat_template

    def info(self) -> dict[str, Any]:
        from runlm.store.inspect import inspect_model

        i = inspect_model(self.path)
        return {"architecture": i.architecture, "parameters": i.parameter_size, "context length": i.context_length,
                "quantization": i.quantization}

    def reply(self, user_text: str, out: TextIO, images: list[bytes] | None = None) -> str:
        """Stream the assistant's answer to ``out`` and return it. ``images`` (encoded) come with this turn and
        stay in the conversation (the encoder and prefix caches keep later turns from computing them again)."""
        from runlm.engine.llm import encode_chat
        from runlm.engine.types.structured_params import StructuredOutputsParams
        from runlm.formats.chat_images import take_images
        from runlm.tools.reasoning import parser_for_template

        if images and "image" not in self.engine.modalities:
            raise ValueError(f"the model {self.name} does not accept images (it is a text-only model)")
        tok = self.engine.tokenizer
        self.history.append(user_message(user_text, images or []))
        messages, pictures = take_images(self.history)
        kwargs: dict[str, Any] = self.options.template_kwargs()
        ids = encode_chat(tok, messages, **kwargs)
        self._turn += 1
        rid = f"turn-{self._turn}"
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if pictures:
            prompt["multi_modal_data"] = {"image": pictures}
        params = replace(self.params)
        if self.options.format_json:
            params.structured_outputs = StructuredOutputsParams(json_object=True)
        parser = parser_for_template(tok.chat_template)
        splitter = parser.splitter(parser.starts_inside(tok.decode(ids[-32:]))) if parser else None
        printer = TurnPrinter(out, Turn(prompt_tokens=len(ids)), self.options.hide_thinking)
        try:
            self.engine.add_request(rid, prompt, params, output_kind=DELTA, lora_request=self.lora)
        except Exception:
            self.history.pop()
            raise
        try:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    assert isinstance(o, RequestOutput)  # add_request refused anything but generation
                    piece = o.outputs[0]
                    printer.push(*(splitter.push(piece.text, o.finished) if splitter else ("", piece.text)),
                                 len(piece.token_ids))
        except KeyboardInterrupt:
            self.engine.abort_request(rid)
            raise
        turn = self.last_turn = printer.finish(self.options.verbose)
        self.history.append(turn.message())
        return turn.text


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
    from runlm.cli.chat_commands import interactive
    from runlm.cli.client import connect
    from runlm.cli.run_daemon import DaemonChat

    daemon = connect()
    options = ChatOptions(verbose=args.verbose, format_json=args.format == "json",
                          think=None if args.think is None else args.think == "true", hide_thinking=args.hidethinking)

    def open_model(ref: str) -> Chat | DaemonChat:
        if daemon is not None:  # the daemon has the model loaded already, or loads it once for everyone
            _stored_on_daemon(daemon, ref)
            params = run_params(flags, _recommended_on_daemon(daemon, ref))
            return DaemonChat(daemon, ref, params, args.system, replace(options))
        model = local_model(ref)
        return Chat(ref, run_params(flags, model.sampling), args.system, args.exact_numerics, args.threads, model,
                    replace(options))

    try:
        chat = open_model(args.model or DEFAULT_MODEL)
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
            interactive(chat, images, open_model)
    except (ChatTemplateError, ValueError) as exc:
        print(f"\nrunlm run: {exc}", file=sys.stderr)
        return 1
    return 0
