"""The listening socket both servers (serve-engine and the image server) open before they load."""
from __future__ import annotations

import os
import socket
import stat
from pathlib import Path


def open_socket(host: str, port: int, uds: str | None) -> tuple[socket.socket, str]:
    """The listening socket and how to reach it. A Unix socket is private to this user (0600)."""
    if uds is not None:
        path = Path(uds)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise OSError(f"{path} exists and is not a socket; refusing to replace it")
            path.unlink()  # a stale socket from an earlier run
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o077)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        return sock, f"unix:{path}"
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
    return sock, f"http://{shown}:{bound[1]}"
