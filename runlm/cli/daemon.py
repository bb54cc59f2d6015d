"""``runlm serve | ps | stop | status | configure | install-backend``: the daemon and its backends."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import time
from pathlib import Path

from runlm.cli.arguments import add_serving_arguments, serving_keys_and_tls
from runlm.cli.client import CLIError, connect, print_json, print_table
from runlm.store.progress import human_bytes, human_duration


def cmd_serve(args: argparse.Namespace) -> int:
    from runlm.runner.app import HTTPSettings
    from runlm.runner.backends.base import default_context
    from runlm.runner.config import ConfigError, parse_keep_alive
    from runlm.runner.daemon import serve
    from runlm.runner.memory import MemoryBudget
    from runlm.sizes import parse_size
    from runlm.store import ModelStore

    try:
        budget = MemoryBudget(parse_size(args.memory_budget)) if args.memory_budget else None
        keep_alive = parse_keep_alive(args.keep_alive) if args.keep_alive else None
        default_context()  # a bad $RUNLM_CONTEXT_LENGTH / $OLLAMA_CONTEXT_LENGTH stops the start, not each load
        keys, tls = serving_keys_and_tls(args)
    except (ValueError, ConfigError) as exc:
        raise CLIError(str(exc), code=2) from None
    running = connect()
    if running is not None and not args.force:
        raise CLIError(f"a runlm daemon already serves this store at {running.url}")
    local = Path(args.allow_local_import).expanduser() if args.allow_local_import else None
    if local is not None and not local.is_dir():
        raise CLIError(f"--allow-local-import {args.allow_local_import}: not a folder", code=2)
    try:
        http = HTTPSettings(args.host, frozenset(args.allowed_hosts), frozenset(args.allowed_origins),
                            parse_size(args.max_body_size))
    except ValueError as exc:
        raise CLIError(str(exc), code=2) from None
    serve(args.host, args.port, ModelStore(), tls, budget=budget, keep_alive=keep_alive, api_key=keys or None,
          allow_local_import=local, http=http)
    return 0


def _until(r: dict) -> str:
    if r["in_use"] or not r["ready"]:
        return "in use" if r["ready"] else "loading"
    if r["expires_at"] is None:
        return "Forever"
    return f"{human_duration(max(0, r['expires_at'] - time.time()))} from now"


def cmd_ps(args: argparse.Namespace) -> int:
    runners = connect(required=True).call("GET", "/engines/ps")
    if args.json:
        print_json(runners)
        return 0
    rows = [[r["model_name"], r["model_id"].removeprefix("sha256:")[:12], r["backend_name"], r["mode"],
             human_bytes(r["memory"]["ram"] + r["memory"]["vram"]),
             human_bytes(r["resident"]) if r.get("resident") is not None else "-", r.get("kv_cache_dtype") or "-",
             str(r["pid"] or "-"), _until(r)] for r in runners]
    # SIZE: what the runner reserved for it (weights + a full KV cache); RESIDENT: what its process holds now;
    # KV: the KV cache's storage (--kv-cache-dtype), where the backend says
    print_table(rows, ["NAME", "ID", "BACKEND", "MODE", "SIZE", "RESIDENT", "KV", "PID", "UNTIL"])
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    if not args.models and not args.all:
        raise CLIError("name the models to unload, or --all", code=2)
    body = {"all": True} if args.all else {"models": args.models}
    out = connect(required=True).call("POST", "/engines/unload", body)
    print(f"unloaded {out['unloaded_runners']} runner(s)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    daemon = connect()
    if daemon:
        statuses = daemon.call("GET", "/engines/status")
    else:
        from runlm.runner.backends import all_backends
        from runlm.store import ModelStore

        statuses = {n: b.status() for n, b in all_backends(ModelStore().logs).items()}
    if args.json:
        print_json({"daemon": daemon.url if daemon else None, "backends": statuses})
        return 0
    print(f"daemon: {'running at ' + daemon.url if daemon else 'not running (start it with: runlm serve)'}")
    print_table([[n, s] for n, s in statuses.items()], ["BACKEND", "STATUS"])
    return 0


def cmd_configure(args: argparse.Namespace) -> int:
    body: dict = {"model": args.model}
    if args.context_size is not None:
        body["context-size"] = args.context_size
    if args.runtime_flags:
        body["runtime-flags"] = shlex.split(args.runtime_flags)
    if args.keep_alive is not None:
        body["keep_alive"] = args.keep_alive
    if args.draft_model:
        body["speculative"] = {"draft_model": args.draft_model, "num_tokens": args.num_tokens,
                               "min_acceptance_rate": args.min_acceptance_rate}
    if args.reasoning_budget is not None:
        body["llamacpp"] = {"reasoning-budget": args.reasoning_budget}
    if args.lora:
        body["loras"] = _import_loras(args.lora)
    if args.chat_template_file:  # read here, as the user: the daemon takes the text, never a path
        from runlm.cli.serve_engine import read_chat_template_file

        try:
            body["chat-template"] = read_chat_template_file(args.chat_template_file)
        except ValueError as exc:
            raise CLIError(str(exc), code=2) from None
    if args.gpu_memory_utilization is not None or args.hf_overrides:
        try:
            overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
        except json.JSONDecodeError as exc:
            raise CLIError(f"--hf-overrides is not JSON: {exc}", code=2) from None
        body["vllm"] = {k: v for k, v in (("gpu-memory-utilization", args.gpu_memory_utilization),
                                          ("hf-overrides", overrides)) if v is not None}
    path = f"/engines/{args.backend}/_configure" if args.backend else "/engines/_configure"
    out = connect(required=True).call("POST", path, body)
    if args.json:
        print_json(out)
    else:
        print(f"configured {out['model']} on the {out['backend']} backend: {json.dumps(out['config'])}")
    return 0


def _import_loras(items: list[str]) -> dict[str, dict[str, str]]:
    """NAME=PATH adapters -> {NAME: {file: digest}}, their files copied into the store the daemon reads."""
    from pathlib import Path

    from runlm.runner.config import ConfigError
    from runlm.runner.lora import import_adapter
    from runlm.store import ModelStore

    blobs = ModelStore().blobs
    loras: dict[str, dict[str, str]] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise CLIError(f"--lora takes NAME=PATH, not {item!r}", code=2)
        try:
            loras[name] = import_adapter(blobs, Path(path).expanduser().resolve())
        except ConfigError as exc:
            raise CLIError(str(exc), code=2) from None
    return loras


def cmd_install_backend(args: argparse.Namespace) -> int:
    from runlm.runner.backends import BackendError, all_backends
    from runlm.store import ModelStore

    backends = all_backends(ModelStore().logs)
    backend = backends.get(args.backend)
    if backend is None:
        raise CLIError(f"unknown backend {args.backend!r} (backends: {', '.join(backends)})", code=2)
    if backend.installed():
        print(f"{args.backend}: already installed ({backend.status()})")
        return 0
    print(f"installing the {args.backend} backend...", flush=True)
    try:
        asyncio.run(backend.install())
    except BackendError as exc:
        raise CLIError(str(exc)) from None
    print(f"{args.backend}: {backend.status()}")
    return 0


def _env_list(name: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, "").split(",") if x.strip()]


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from runlm.runner.daemon import DEFAULT_HOST, DEFAULT_PORT

    p = sub.add_parser("serve", help="run the daemon: Model Runner, OpenAI and Ollama APIs",
                       description="Serve the store's models, loading each on its first request.")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="memory for loaded models, e.g. 8GiB (default: 75%% of RAM)")
    p.add_argument("--keep-alive", default=None, metavar="DURATION",
                   help="how long an idle model stays loaded (default 5m; 0 = unload at once; -1 = forever)")
    add_serving_arguments(p, "every request")
    p.add_argument("--allow-local-import", default=None, metavar="DIR",
                   help="let HTTP pulls (/api/pull, /models/create) import local files, only from under DIR "
                        "(default: none; the CLI imports local files itself)")
    p.add_argument("--allowed-origins", nargs="*", metavar="ORIGIN", default=_env_list("RUNLM_ORIGINS"),
                   help="web page origins (besides localhost ones) that may send requests, e.g. "
                        "https://app.example; '*' allows any (default: $RUNLM_ORIGINS, comma-separated)")
    p.add_argument("--allowed-hosts", nargs="*", metavar="HOST", default=_env_list("RUNLM_ALLOWED_HOSTS"),
                   help="Host names answered besides loopback ones; '*' answers any "
                        "(default: $RUNLM_ALLOWED_HOSTS, comma-separated)")
    p.add_argument("--max-body-size", default="32MiB", metavar="SIZE", help="largest request body (default 32MiB)")
    p.add_argument("--force", action="store_true", help="start even if daemon.json names a live daemon")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("ps", help="list loaded models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ps)
    p = sub.add_parser("stop", help="unload models")
    p.add_argument("models", nargs="*")
    p.add_argument("--all", action="store_true")
    p.set_defaults(func=cmd_stop)
    p = sub.add_parser("status", help="is the daemon running, and the state of each backend")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("configure", help="set how a model is loaded (context size, flags, keep-alive, ...)")
    p.add_argument("model")
    p.add_argument("--backend", default=None, help="native, llamacpp, vllm or diffusers")
    p.add_argument("--context-size", type=int, default=None)
    p.add_argument("--runtime-flags", default=None, help="allow-listed backend flags, e.g. '--max-num-seqs 8'")
    p.add_argument("--keep-alive", default=None, help="5m, 1h, 0 (unload after each request), -1 (never)")
    p.add_argument("--draft-model", default=None, help="speculative decoding: the draft model's name")
    p.add_argument("--num-tokens", type=int, default=5, help="speculative decoding: tokens drafted per step")
    p.add_argument("--min-acceptance-rate", type=float, default=0.0)
    p.add_argument("--reasoning-budget", type=int, default=None, help="llamacpp: reasoning budget (-1: unlimited)")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="a chat template (Jinja or Ollama's Go) for the model instead of its own (native backend; a "
                        "request's own, where the backend trusts them, still wins)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="native: serve a LoRA adapter (PEFT directory or GGUF LoRA file) as model NAME; repeatable")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="vllm: fraction of GPU memory")
    p.add_argument("--hf-overrides", default=None, help="vllm: JSON object of config overrides")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_configure)
    p = sub.add_parser("install-backend", help="install a backend (llamacpp: pip install llama-cpp-python[server]; "
                                               "diffusers: pip install diffusers transformers)")
    p.add_argument("backend")
    p.set_defaults(func=cmd_install_backend)
