"""``runlm serve``: run the app with uvicorn and tell the CLI where to find it ($RUNLM_HOME/daemon.json)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from runlm.store import ModelStore, default_home

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 12434


def daemon_file(home: Path | None = None) -> Path:
    return (home or default_home()) / "daemon.json"


@dataclass(slots=True)
class DaemonAddress:
    url: str
    pid: int | None = None
    certificate: str | None = None  # a daemon serving HTTPS: the certificate its clients here trust


def find_daemon(home: Path | None = None) -> DaemonAddress | None:
    """RUNLM_HOST when set; else the daemon that serves this RUNLM_HOME, if it is still alive."""
    if os.environ.get("RUNLM_HOST"):
        host = os.environ["RUNLM_HOST"]
        return DaemonAddress(host if "://" in host else f"http://{host}")
    try:
        data = json.loads(daemon_file(home).read_text())
        os.kill(int(data["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    cert = data.get("certificate")
    return DaemonAddress(data["url"], int(data["pid"]), cert if isinstance(cert, str) else None)


def serve(host: str, port: int, store: ModelStore, tls: dict[str, str] | None = None, **app_args: object) -> None:
    """``tls``: uvicorn's ssl_keyfile and ssl_certfile, for HTTPS."""
    import uvicorn

    from runlm.runner.app import create_app

    app = create_app(store, **app_args)  # type: ignore[arg-type]
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                            ssl_keyfile=(tls or {}).get("ssl_keyfile"), ssl_certfile=(tls or {}).get("ssl_certfile"))
    server = uvicorn.Server(config)
    path = daemon_file(store.home)
    path.parent.mkdir(parents=True, exist_ok=True)
    shown = f"[{host}]" if ":" in host else host
    url = f"{'https' if tls else 'http'}://{shown}:{port}"
    path.write_text(json.dumps({"url": url, "pid": os.getpid(),
                                **({"certificate": tls["ssl_certfile"]} if tls else {})}))
    print(f"runlm serving on {url} (store: {store.home})", flush=True)
    try:
        server.run()
    finally:
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass
