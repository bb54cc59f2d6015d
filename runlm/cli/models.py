"""``runlm pull | ls | show | tag | rm | df | purge``: the model store, through the daemon when one runs."""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from runlm.cli.client import CLIError, connect, print_json, print_table
from runlm.runner.views import group_by_id, model_json
from runlm.store import InvalidNameError, ModelNotFoundError, ModelStore
from runlm.store.capabilities import capabilities, input_modalities
from runlm.store.progress import ProgressBar, PullProgress, human_bytes


def _ago(unix: int) -> str:
    seconds = max(0, int(dt.datetime.now(dt.UTC).timestamp()) - unix)
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if seconds >= size:
            n = seconds // size
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "Less than a minute ago" if seconds >= 5 else "Just now"


def _store_call(fn, *args):  # store errors -> one-line CLI errors
    try:
        return fn(*args)
    except (InvalidNameError, ModelNotFoundError) as exc:
        raise CLIError(str(exc)) from None


def cmd_pull(args: argparse.Namespace) -> int:
    bar = ProgressBar(sys.stderr)
    daemon = connect()
    # a local file is read by the CLI, as the user who runs it: the daemon's HTTP API reads no local paths
    if daemon and daemon.shares_store and Path(args.source).expanduser().exists():
        daemon = None
    mmproj = Path(args.mmproj).expanduser() if getattr(args, "mmproj", None) else None
    if mmproj is not None and daemon:
        raise CLIError("--mmproj goes with a local GGUF file, imported by the CLI into a store this machine holds")
    try:
        if daemon:
            body = {"from": args.source, **({"name": args.name} if args.name else {}),
                    **({"insecure": True} if args.insecure else {})}
            for msg in daemon.stream("/models/create", body):
                if msg["type"] == "progress":
                    bar(PullProgress(msg["message"], None, msg.get("total", 0), msg.get("pulled", 0)))
                elif msg["type"] == "error":
                    raise CLIError(msg["message"])  # (the progress stream already ended with "success")
        else:
            try:
                ModelStore().pull(args.source, args.name, progress=bar, insecure=args.insecure, mmproj=mmproj)
            except Exception as exc:  # the store's errors are for people: print them, no traceback
                if isinstance(exc, KeyboardInterrupt):
                    raise
                raise CLIError(f"{exc}") from None
    finally:
        bar.close()
    return 0


def _models_json() -> list[dict]:
    daemon = connect()
    if daemon:
        return daemon.call("GET", "/models")
    return [model_json(g) for g in group_by_id(ModelStore().list())]


def cmd_ls(args: argparse.Namespace) -> int:
    models = _models_json()
    if args.json:
        print_json(models)
        return 0
    rows = [[tag, m["id"].removeprefix("sha256:")[:12], human_bytes(m["config"]["size"]), _ago(m["created"])]
            for m in models for tag in m["tags"]]
    registry = {tag: r for m in models for tag, r in (m.get("registry") or {}).items()}
    if not registry:
        print_table(sorted(rows), ["NAME", "ID", "SIZE", "MODIFIED"])
        return 0
    for row in rows:  # models packaged, pushed or pulled as OCI artifacts: where they are and their digest
        r = registry.get(row[0]) or {}
        row += [r.get("reference") or "-", (r.get("digest") or "-").removeprefix("sha256:")[:12]]
    print_table(sorted(rows), ["NAME", "ID", "SIZE", "MODIFIED", "REGISTRY REFERENCE", "DIGEST"])
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    daemon = connect()
    if args.modelfile:
        if daemon:
            print(daemon.call("POST", "/api/show", {"model": args.model})["modelfile"], end="")
        else:
            from runlm.store.modelfile_model import show_modelfile

            print(show_modelfile(_store_call(ModelStore().get, args.model)), end="")
        return 0
    if daemon:
        m = daemon.call("GET", f"/models/{args.model}")
    else:
        store = ModelStore()
        model = _store_call(store.get, args.model)
        m = model_json([x for x in store.list() if x.id == model.id])
        m["config"].update(template=model.info.template, capabilities=capabilities(model),
                           input_modalities=input_modalities(model))
    if args.json:
        print_json(m)
        return 0
    c = m["config"]
    print("  Model")
    for label, value in (("format", c["format"]), ("architecture", c["architecture"]),
                         ("parameters", c["parameters"]), ("quantization", c["quantization"]),
                         ("context length", c["context_size"] or "-"), ("size", human_bytes(c["size"])),
                         ("capabilities", ", ".join(c.get("capabilities", []))),
                         ("input", ", ".join(c.get("input_modalities", ["text"]))), ("digest", m["id"]),
                         ("tags", ", ".join(m["tags"]))):
        print(f"    {label:<16}{value}")
        if label == "parameters" and c.get("experts"):
            print(f"    {'experts':<16}{c['experts']} ({c['experts_used']} active per token)")
    if c.get("components"):  # a diffusers pipeline: its architecture is the pipeline class
        print("\n  Components")
        for name, cls in c["components"].items():
            print(f"    {name:<16}{cls}")
    if c.get("sampling"):  # what requests and `runlm run` use when they set none (Ollama's "Parameters")
        print("\n  Parameters")
        for name, value in c["sampling"].items():
            print(f"    {name:<20}{value}")
    if c.get("template"):
        print("\n  Template")
        print("\n".join("    " + line for line in c["template"].splitlines()))
    return 0


def cmd_tag(args: argparse.Namespace) -> int:
    daemon = connect()
    if daemon:
        daemon.call("POST", f"/models/{args.source}/tag", {"target": args.target})
    else:
        _store_call(ModelStore().tag, args.source, args.target)
    print(f"tagged {args.source} as {args.target}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    daemon = connect()
    for name in args.models:
        if daemon:
            daemon.call("DELETE", f"/models/{name}", None, **({"force": "true"} if args.force else {}))
        else:
            _store_call(ModelStore().remove, name)
        print(f"deleted '{name}'")
    return 0


def cmd_df(args: argparse.Namespace) -> int:
    daemon = connect()
    if daemon:
        usage = daemon.call("GET", "/engines/df")
    else:
        local = ModelStore().disk_usage()
        usage = {"models_disk_usage": local["models"], "partial_downloads": local["partial"]}
    if args.json:
        print_json(usage)
        return 0
    rows = [["models", human_bytes(usage["models_disk_usage"])],
            ["partial downloads", human_bytes(usage["partial_downloads"])]]
    rows += [[f"backend {n}", human_bytes(v)] for n, v in usage.get("backends_disk_usage", {}).items()]
    print_table(rows, ["TYPE", "SIZE"])
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    if connect():
        raise CLIError("a runlm daemon is running on this store; stop it before purging")
    if not args.force:
        raise CLIError("this removes every model in the store; run again with --force to do it", code=2)
    freed = ModelStore().purge()
    print(f"removed every model ({human_bytes(freed)})")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="store a model: a built-in name, a file, a URL, a Hugging Face repo or an OCI "
                                    "registry reference")
    p.add_argument("source", help="smollm2 | ./model.gguf | ./model-dir | https://.../m.gguf[#sha256=HEX] | org/repo | "
                                  "registry.example:5000/namespace/name:tag (an OCI registry)")
    p.add_argument("--name", default=None, help="name[:tag] to store it under (default: from the source)")
    p.add_argument("--insecure", action="store_true", help="a registry over plain http (only for one you trust)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="llama.cpp's multimodal projector (mmproj GGUF) to keep with a GGUF model, for images "
                        "(default: an mmproj-*.gguf beside the model file)")
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("ls", aliases=["list"], help="list stored models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)
    p = sub.add_parser("show", help="a model's format, architecture, size, context length, template")
    p.add_argument("model")
    p.add_argument("--json", action="store_true")
    p.add_argument("--modelfile", action="store_true",
                   help="print it as Ollama's Modelfile (FROM, PARAMETER, TEMPLATE)")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("tag", help="give a stored model another name")
    p.add_argument("source")
    p.add_argument("target")
    p.set_defaults(func=cmd_tag)
    p = sub.add_parser("rm", help="delete models (refused while loaded unless --force)")
    p.add_argument("models", nargs="+")
    p.add_argument("--force", action="store_true", help="unload the model first if it is loaded")
    p.set_defaults(func=cmd_rm)
    p = sub.add_parser("df", help="disk space used by models and backends")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_df)
    p = sub.add_parser("purge", help="delete every model and partial download in the store")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_purge)
