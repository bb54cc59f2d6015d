"""``runlm package | push | login | logout | inspect``: models as OCI artifacts in a registry."""
from __future__ import annotations

import argparse
import getpass
import json
import sys
from pathlib import Path

from runlm.cli.client import CLIError, connect, print_json
from runlm.store import ModelStore
from runlm.store.progress import ProgressBar, PullProgress


def _store_errors(fn, *args, **kwargs):  # the store's and the registry's errors are for people: no traceback
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, CLIError):
        raise
    except Exception as exc:
        raise CLIError(str(exc)) from None


def cmd_package(args: argparse.Namespace) -> int:
    from runlm.store.oci.reference import looks_like_reference, parse_reference
    from runlm.store.oci.transfer import default_name, package, push

    target = args.name
    name = str(default_name(parse_reference(target))) if looks_like_reference(target) else target
    if args.push and not looks_like_reference(target):
        raise CLIError("--push needs NAME to be a registry reference (host[:port]/namespace/name:tag)", code=2)
    bar = ProgressBar(sys.stderr)
    try:
        model = _store_errors(package, ModelStore(), Path(args.source).expanduser(), name,
                              tuple(Path(p).expanduser() for p in args.license), args.context_size, bar,
                              Path(args.mmproj).expanduser() if args.mmproj else None)
        if args.push:
            _store_errors(push, ModelStore(), name, target, args.insecure, bar)
    finally:
        bar.close()
    pushed = f", pushed to {target}" if args.push else ""
    print(f"packaged {model.name} ({model.manifest['oci']['manifest']}){pushed}")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from runlm.store.oci.reference import looks_like_reference
    from runlm.store.oci.transfer import push, push_reference

    bar = ProgressBar(sys.stderr)
    daemon = connect()
    try:
        if daemon and not daemon.shares_store:  # the models are the daemon's: it pushes them
            body, digest = {"target": args.target, "insecure": args.insecure}, ""
            for msg in daemon.stream(f"/models/{args.model}/push", body):
                if msg["type"] == "progress":
                    bar(PullProgress(msg["message"], None, msg.get("total", 0), msg.get("pushed", 0)))
                elif msg["type"] == "error":
                    raise CLIError(msg["message"])
                else:
                    digest = msg.get("digest", "")
            ref = args.target or args.model
        elif args.target is None and looks_like_reference(args.model):
            ref, digest = _store_errors(push_reference, ModelStore(), args.model, args.insecure, bar)
        else:
            ref, digest = _store_errors(push, ModelStore(), args.model, args.target, args.insecure, bar)
    finally:
        bar.close()
    print(f"pushed {ref} ({digest})")
    return 0


def cmd_login(args: argparse.Namespace) -> int:
    from runlm.store.oci.client import RegistryClient
    from runlm.store.oci.credentials import Credentials, save

    user = args.username or input("Username: ")
    password = sys.stdin.readline().rstrip("\n") if args.password_stdin else getpass.getpass("Password: ")
    if not user or not password:
        raise CLIError("a user name and a password (or token) are needed", code=2)
    creds = Credentials(user, password)
    with RegistryClient(args.registry, creds, insecure=args.insecure) as client:
        _store_errors(client.ping)
    path = save(args.registry, creds, ModelStore().home)
    print(f"Login Succeeded (credentials kept in {path}, readable by you alone)")
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    from runlm.store.oci.credentials import forget

    if not forget(args.registry, ModelStore().home):
        raise CLIError(f"not logged in to {args.registry}")
    print(f"Removed login credentials for {args.registry}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """The model's OCI manifest and config: the stored one, or with --remote the registry's (nothing pulled)."""
    if args.remote:
        from runlm.store.oci.transfer import inspect_remote

        print_json(_store_errors(inspect_remote, ModelStore(), args.model, args.insecure))
        return 0
    store = ModelStore()
    model = _store_errors(store.get, args.model)
    oci = model.manifest.get("oci") or {}
    out: dict = {"name": str(model.name), "id": model.id, "files": model.manifest["files"],
                 "info": model.info.to_json()}
    if oci.get("manifest"):
        out |= {"reference": oci.get("reference"), "digest": oci["manifest"],
                "manifest": json.loads(store.blobs.path(oci["manifest"]).read_bytes()),
                "config": json.loads(store.blobs.path(oci["config"]).read_bytes()) if oci.get("config") else None}
    print_json(out)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("package", help="store a GGUF file or model folder as an OCI artifact (Docker Model Runner's "
                                       "format), ready to push")
    p.add_argument("source", metavar="FILE|DIR", help="a .gguf file or a model folder")
    p.add_argument("name", metavar="NAME", help="name[:tag] to store it under, or a registry reference with --push")
    p.add_argument("--license", action="append", default=[], metavar="FILE", help="a license file (repeatable)")
    p.add_argument("--context-size", type=int, default=None, metavar="N", help="the context size to run it with")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="llama.cpp's multimodal projector (mmproj GGUF), a layer of its own (default: an mmproj-*.gguf "
                        "beside a GGUF file)")
    p.add_argument("--push", action="store_true", help="push it to NAME (a registry reference) once packaged")
    p.add_argument("--insecure", action="store_true", help="plain http to the registry (only for one you trust)")
    p.set_defaults(func=cmd_package)
    p = sub.add_parser("push", help="push a stored model to an OCI registry")
    p.add_argument("model", metavar="NAME", help="a stored model (or the registry reference it was pulled from)")
    p.add_argument("target", nargs="?", default=None, metavar="REGISTRY/REPO:TAG",
                   help="where to push (default: the registry reference the model came from)")
    p.add_argument("--insecure", action="store_true", help="plain http to the registry (only for one you trust)")
    p.set_defaults(func=cmd_push)
    p = sub.add_parser("login", help="check and keep credentials for an OCI registry (file mode 0600)")
    p.add_argument("registry", metavar="REGISTRY", help="host[:port]")
    p.add_argument("-u", "--username", default=None)
    p.add_argument("--password-stdin", action="store_true", help="read the password or token from stdin")
    p.add_argument("--insecure", action="store_true", help="plain http to the registry")
    p.set_defaults(func=cmd_login)
    p = sub.add_parser("logout", help="forget the credentials kept for a registry")
    p.add_argument("registry", metavar="REGISTRY")
    p.set_defaults(func=cmd_logout)
    p = sub.add_parser("inspect", help="a model's OCI manifest and config (--remote: the registry's, without pulling)")
    p.add_argument("model", metavar="NAME", help="a stored model, or with --remote a registry reference")
    p.add_argument("--remote", action="store_true", help="read the manifest from the registry; pull nothing")
    p.add_argument("--insecure", action="store_true", help="plain http to the registry")
    p.set_defaults(func=cmd_inspect)
