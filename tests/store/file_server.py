"""A real HTTP server for pull tests: serves files with Range support, logs requests, can break off."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Served:
    path: Path
    cut_after: int | None = None  # first response stops (connection closed) after this many bytes
    delay: float = 0.0            # seconds between 256 KiB chunks (to make pulls overlap)
    etag: str | None = '"v1"'     # sent with every answer; a Range whose If-Range differs gets the whole file
    redirect_to: str | None = None  # answer 302 to this path instead
    content_range_start: int | None = None  # lie about where a 206 starts


@dataclass
class FileServer:
    files: dict[str, Served] = field(default_factory=dict)
    log: list[tuple[str, str | None, int]] = field(default_factory=list)  # (path, Range header, bytes sent)

    def start(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                served = server.files.get(self.path)
                if served is None:
                    self.send_error(404)
                    return
                if served.redirect_to is not None:
                    self.send_response(302)
                    self.send_header("Location", served.redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    server.log.append((self.path, None, 0))
                    return
                data = served.path.read_bytes()
                rng = self.headers.get("Range")
                if rng and self.headers.get("If-Range") not in (None, served.etag):
                    rng = None  # the file changed: the whole of it, as RFC 9110 says
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
                if start >= len(data) and rng:
                    self.send_response(416)
                    self.end_headers()
                    server.log.append((self.path, self.headers.get("Range"), 0))
                    return
                self.send_response(206 if rng else 200)
                self.send_header("Content-Length", str(len(data) - start))
                if served.etag:
                    self.send_header("ETag", served.etag)
                if rng:
                    shown = start if served.content_range_start is None else served.content_range_start
                    self.send_header("Content-Range", f"bytes {shown}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                body = data[start:]
                if served.cut_after is not None:
                    body, served.cut_after = body[:served.cut_after], None
                sent = 0
                for i in range(0, len(body), 256 << 10):
                    self.wfile.write(body[i:i + (256 << 10)])
                    sent += len(body[i:i + (256 << 10)])
                    if served.delay:
                        time.sleep(served.delay)
                server.log.append((self.path, self.headers.get("Range"), sent))
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
