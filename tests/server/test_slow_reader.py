"""Clients that open streams and never read them (issue 15, faults): the server's memory stays bounded, and it
keeps answering others."""
from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import psutil

from tests.server.process import ServerProcess

REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s")
BODY = b'{"prompt": "once", "max_tokens": 1000, "ignore_eos": true, "stream": true}'


def test_streams_nobody_reads_do_not_grow_memory() -> None:
    server = ServerProcess("tinycoder", ["--kv-cache-memory", "64MiB"]).start()
    sockets = []
    try:
        proc = psutil.Process(server.proc.pid)
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 8}, timeout=60)  # warm
        before = proc.memory_info().rss
        host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
        for _ in range(16):
            s = socket.create_connection((host, port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and then never read
            s.sendall(REQUEST % (len(BODY), BODY))
            sockets.append(s)
        peak = before
        for _ in range(20):  # while the 16 generations run
            time.sleep(0.5)
            peak = max(peak, proc.memory_info().rss)
            ok = httpx.get(f"{server.url}/health", timeout=10)
            assert ok.status_code == 200
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        assert peak - before < 64 << 20, f"RSS grew by {(peak - before) >> 20} MiB for 16 unread streams"
    finally:
        for s in sockets:
            s.close()
        server.stop()
