"""``runlm serve-engine MODEL``: the OpenAI-compatible server over one engine (like ``vllm serve``).

The socket is opened first and the model loads behind it: ``/liveness`` answers at once,
``/health`` and ``/readiness`` answer 503 until the model is ready. If loading fails the process
exits with status 1, so a supervisor (the runner) sees the failure.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runlm.catalog import UnknownModelError, resolve_model
from runlm.cli.arguments import add_numerics_arguments, add_serving_arguments, serving_keys_and_tls
from runlm.kv_size import KV_CACHE_DTYPES
from runlm.web.listen import open_socket

if TYPE_CHECKING:
    from runlm.server.state import ServerState


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-engine", help="serve one model over an OpenAI-compatible HTTP API",
                       description="Serve MODEL over the OpenAI API (/v1/chat/completions, /v1/completions, "
                                   "/v1/models, ...) on 127.0.0.1:8000, or on a Unix socket with --uds.")
    p.add_argument("model", help="built-in name (smollm2, tinycoder), a .gguf file or a model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    where.add_argument("--uds", default=None, metavar="PATH", help="listen on this Unix socket instead (mode 0600)")
    add_serving_arguments(p, "every request but the probes")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="a chat template (Jinja, or Ollama's Go template) to use instead of the model's (a request's "
                        "own, under --trust-request-chat-template, still wins)")
    p.add_argument("--model-defaults-file", default=None, metavar="FILE",
                   help="JSON {system, messages, stop}: a system prompt for chats without one, messages put before "
                        "every chat and stop strings for requests without any (what `runlm create` stores from a "
                        "Modelfile's SYSTEM, MESSAGE and PARAMETER stop lines)")
    p.add_argument("--context-shift", action="store_true",
                   help="a generation that fills the context goes on, dropping the oldest half of what follows the "
                        "request's n_keep tokens (llama-server's flag; a request's context_shift says otherwise)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) clients use for the model (default: MODEL as given); others get 421")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--task", default="auto", choices=("auto", "generate", "embed", "score"),
                   help="what to serve the model for (default: from its files; 'embed' makes a decoder an "
                        "embedder with last-token pooling)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences run together (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step (default 512)")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help="KV-cache size: bytes such as 2GiB, or a fraction of free memory such as 0.3")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV-cache storage (default auto: fp32 on the CPU; q8_0: llama.cpp's 8-bit blocks, ~3.8x "
                        "the tokens in the same memory, native runner only; fp8: float8 e4m3, the GPU runner's)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="sequences that may wait beyond --max-num-seqs before requests get 503 (default 256)")
    p.add_argument("--max-body-size", default="32MiB", metavar="SIZE",
                   help="largest request body (default 32MiB: room for a 20 MiB image as base64)")
    p.add_argument("--cors-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="origins browsers may call from (default: none)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running requests may take to finish while new ones get 503 "
                        "(default 30; 0: stop at once)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests replace the model's chat template (chat_template_kwargs.chat_template)")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: requests name one in 'model'; /v1/load_lora_adapter adds more")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters to load at start (a PEFT directory or a GGUF LoRA file each)")
    p.add_argument("--max-loras", type=int, default=1, help="adapters used in one engine step (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded, least recently used evicted first (default: --max-loras)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="llama.cpp's multimodal projector (mmproj GGUF) for a vision model's text GGUF")
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="image=N",
                   help='the most images one request may hold: image=N or \'{"image": N}\' (vLLM\'s flag; default 16)')
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="DOMAIN",
                   help="fetch http(s) image URLs from these hosts ('*.example.com' for its subdomains); default: "
                        "none, images come inline as data: URLs (file:// and other schemes are always refused)")
    p.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="how long fetching one image URL may take (default 10)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda; auto: cuda where a GPU is found)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="on a GPU, the share of its memory for weights, activations and the KV cache (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every step eagerly (no CUDA graphs for decode)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, queue each step while the one before it runs and read its tokens after "
                        "(default on; --no-async-scheduling waits for every step before scheduling the next)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N processes (tensor parallelism, gloo on CPUs; default 1)")
    p.add_argument("--n-gpu-layers", "-ngl", type=int, default=None, metavar="K",
                   help="on a GPU, keep the model's last K layers there and run the others on the CPU (layer offload, "
                        "llama.cpp's flag; -1: all; default: as many as fit, the whole model where it fits)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"model": DRAFT, "num_speculative_tokens": 4, "min_acceptance_rate": 0.1}\'')
    p.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="shorthand: speculate with this draft model (same vocabulary as MODEL)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="shorthand: draft tokens per step (with --draft-model, or n-gram lookup alone)")
    p.add_argument("--generation-config", default="auto", metavar="{auto,vllm,PATH}",
                   help="sampling defaults for what requests leave out: 'auto' (default) the model's own "
                        "(generation_config.json, GGUF general.sampling.*, the built-in catalogue), 'vllm' none, "
                        "or a folder holding a generation_config.json")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='sampling defaults over those, e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\'')
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N engine replicas in their own processes behind one front end, the threads split between "
                        "them (default 1: one engine in this process)")
    p.add_argument("--distributed-executor-backend", default=None, choices=("mp", "ray"),
                   help="where the replicas run: 'mp' child processes here (default with N > 1), 'ray' actors on "
                        "a Ray cluster; given with N = 1, the one replica can still be scaled (/scale_elastic_ep)")
    p.add_argument("--ray-address", default="auto", help="the Ray cluster for --distributed-executor-backend ray "
                                                         "(default 'auto': the one this machine belongs to)")
    p.add_argument("--profiler-dir", default=os.environ.get("RUNLM_TORCH_PROFILER_DIR"), metavar="DIR",
                   help="where POST /start_profile and /stop_profile write torch.profiler traces "
                        "(default: $RUNLM_TORCH_PROFILER_DIR; none: profiling is off)")
    p.add_argument("--reasoning-parser", default="auto", choices=("auto", "none", "qwen3", "deepseek_r1",
                                                                     "openai_gptoss"),
                   help="where a reasoning model's thinking is in its output, moved to the answer's 'reasoning' "
                        "(vLLM's names; default 'auto': read from the chat template; 'none': all is content)")
    add_numerics_arguments(p)
    p.set_defaults(func=run_serve_engine)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """NAME=PATH pairs (vLLM's --lora-modules form) -> {name: path}."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, not {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def json_object_flag(flag: str, value: str | None) -> dict:
    """A flag's JSON object ({} when the flag is not given); anything else is a ValueError naming the flag."""
    if not value:
        return {}
    try:
        found = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(found, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return found


def speculative_config(args: argparse.Namespace) -> dict | None:
    """--speculative-config JSON, with --draft-model and --num-speculative-tokens filled in (checked by the engine)."""
    spec = json_object_flag("--speculative-config", args.speculative_config)
    if args.draft_model:
        spec["model"] = args.draft_model
    if args.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    return spec or None


def sampling_defaults(args: argparse.Namespace, model_path: Path) -> dict[str, float | int]:
    """--generation-config's defaults with --override-generation-config's over them (vLLM's two flags)."""
    from runlm.catalog import recommended_sampling
    from runlm.formats.sampling_defaults import FIELDS, checked, from_generation_config

    if args.generation_config == "auto":
        found = recommended_sampling(args.model, model_path)
    elif args.generation_config == "vllm":
        found = {}
    else:
        folder = Path(args.generation_config).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ValueError(f"--generation-config: no generation_config.json in {folder}")
        found = from_generation_config(folder)
    override = json_object_flag("--override-generation-config", args.override_generation_config)
    override = {"max_tokens" if k == "max_new_tokens" else k: v for k, v in override.items()}
    good = checked(override)
    if bad := sorted(set(override) - set(good)):
        raise ValueError(f"--override-generation-config: {', '.join(bad)}: each key must be one of "
                         f"{', '.join(FIELDS)} (or max_new_tokens) with a number in its range")
    return {**found, **good}


def _kv_cache_memory(value: str | None) -> str | float | None:
    if value is None:
        return None
    try:
        fraction = float(value)
    except ValueError:
        return value
    return fraction if 0 < fraction <= 1 else value


def _server_class(state: ServerState, drain_seconds: float) -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """SIGTERM drains: new requests get 503 while running ones finish, up to ``drain_seconds``; then the
        server stops. A second signal (or SIGINT) stops it at once."""
        drain_deadline: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGTERM and self.drain_deadline is None and drain_seconds > 0:
                self.drain_deadline = time.monotonic() + drain_seconds
                state.draining = True
                return
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after a graceful shutdown; a requested stop is a clean exit
            # (status 0, the Unix socket removed), not death by signal
            getattr(self, "_captured_signals", []).clear()

        async def on_tick(self, counter: int) -> bool:
            if self.drain_deadline is not None and (state.in_flight_seqs == 0 or
                                                    time.monotonic() > self.drain_deadline):
                self.should_exit = True
            return await super().on_tick(counter)

    return Server


def run_serve_engine(args: argparse.Namespace) -> int:
    import uvicorn

    from runlm.engine.async_llm import AsyncLLM
    from runlm.engine.factory import engine_config, engine_from_config, resolve_speculative
    from runlm.formats.modelfile import ChatDefaults
    from runlm.server import ServerSettings, build_app
    from runlm.server.media import MediaSettings, parse_mm_limit
    from runlm.sizes import parse_size

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model_path = resolve_model(args.model)  # once: the engine takes the path
        keys, tls = serving_keys_and_tls(args)
        chat_template = read_chat_template_file(args.chat_template_file) if args.chat_template_file else None
        chat_defaults = ChatDefaults.read(args.model_defaults_file) if args.model_defaults_file else None
        settings = ServerSettings(served_model_names=args.served_model_name or [args.model], api_key=keys or None,
                                  cors_origins=list(args.cors_origins), max_body_bytes=parse_size(args.max_body_size),
                                  max_waiting=args.max_waiting,
                                  trust_request_chat_template=args.trust_request_chat_template,
                                  enable_lora=args.enable_lora or bool(args.lora_modules),
                                  lora_modules=parse_lora_modules(args.lora_modules),
                                  reasoning_parser=args.reasoning_parser, context_shift=args.context_shift)
        settings.media = MediaSettings(allowed_domains=tuple(args.allowed_media_domains),
                                       fetch_timeout=args.media_fetch_timeout,
                                       limit_per_prompt=parse_mm_limit(args.limit_mm_per_prompt))
        stop = {"stop": list(chat_defaults.stop)} if chat_defaults is not None and chat_defaults.stop else {}
        settings.sampling_defaults = {**sampling_defaults(args, model_path), **stop}
        if settings.sampling_defaults:
            logging.getLogger("runlm.serve").info("sampling defaults for what requests leave out: %s",
                                                  settings.sampling_defaults)
        if args.max_waiting < 0:
            raise ValueError("--max-waiting must be 0 or more")
        if args.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be 1 or more")
        spec = resolve_speculative(speculative_config(args))
        sock, where = open_socket(args.host, args.port, args.uds)
        if tls:
            where = where.replace("http://", "https://", 1)
    except (UnknownModelError, ValueError, OSError) as exc:
        print(f"runlm serve-engine: {exc}", file=sys.stderr)
        return 1
    engine_args = dict(task=args.task, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_cache_memory=_kv_cache_memory(args.kv_cache_memory), kv_cache_dtype=args.kv_cache_dtype,
                       device=args.device,
                       exact_numerics=args.exact_numerics, threads=args.threads,
                       enable_lora=settings.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                       max_cpu_loras=args.max_cpu_loras, speculative_config=spec, mmproj=args.mmproj,
                       limit_mm_per_prompt=settings.media.limit_per_prompt,
                       gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                       async_scheduling=args.async_scheduling,
                       tensor_parallel_size=args.tensor_parallel_size, n_gpu_layers=args.n_gpu_layers)
    if args.device == "auto":
        engine_args["device"] = args.device = _auto_device()
    if args.dtype or args.device.startswith("cuda"):
        engine_args["dtype"] = args.dtype or "bfloat16"
    try:
        engine_cfg = engine_config(model_path, **engine_args)  # typed and frozen, built once
    except ValueError as exc:
        print(f"runlm serve-engine: {exc}", file=sys.stderr)
        return 1
    failed: list[BaseException] = []

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        server.should_exit = True

    def build_engine() -> AsyncLLM:
        if args.data_parallel_size == 1 and args.distributed_executor_backend is None:
            return AsyncLLM(engine=engine_from_config(engine_cfg), profiler_dir=args.profiler_dir)
        # replicas build their own engines: a Ray node resolves the store name in its own store;
        # child processes log at this server's level (they read it from the environment they inherit)
        os.environ["RUNLM_LOG_LEVEL"] = args.log_level
        model = args.model if args.distributed_executor_backend == "ray" else str(model_path)
        return AsyncLLM(model, data_parallel_size=args.data_parallel_size,
                        distributed_executor_backend=args.distributed_executor_backend or "mp",
                        ray_address=args.ray_address, profiler_dir=args.profiler_dir, **engine_args)

    def load_engine() -> AsyncLLM:
        engine = build_engine()
        if chat_template is not None:  # the server renders chat prompts with this template from now on
            engine.tokenizer.chat_template = chat_template
        engine.tokenizer.chat_defaults = chat_defaults
        return engine

    app = build_app(settings, load_engine=load_engine, on_load_error=on_load_error)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                            timeout_graceful_shutdown=5, lifespan="on", **tls)
    server = _server_class(app.state.server, args.drain_timeout)(config)
    print(f"runlm serve-engine: serving {settings.served_model_names[0]!r} on {where}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        if args.uds:
            Path(args.uds).unlink(missing_ok=True)
    if failed:
        print(f"runlm serve-engine: the model failed to load: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def read_chat_template_file(path: str) -> str:
    """--chat-template-file: the file's text, within the size a model's own template may have, and a valid Jinja
    or Go template (a ValueError names what is wrong)."""
    from runlm.formats.template_render import template_problem
    from runlm.formats.tokenizer import MAX_TEMPLATE_FILE
    from runlm.sizes import read_small_text

    text = read_small_text(path, MAX_TEMPLATE_FILE, "--chat-template-file")
    if why := template_problem(text, MAX_TEMPLATE_FILE):
        raise ValueError(f"--chat-template-file {path}: not a usable chat template ({why})")
    return text


def _auto_device() -> str:
    """cuda where torch sees a GPU, else cpu (torch is imported only where the driver shows a GPU: the native
    runner's processes stay torch-free)."""
    import importlib.util

    from runlm.sizes import gpu_memory

    if gpu_memory() is None or importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
