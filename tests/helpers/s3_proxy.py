"""A small HTTP proxy in front of the tests' S3 server (moto's, on 127.0.0.1): requests
pass through unchanged, except those a test chose to fail, which get a real S3 error
response (status and XML body) the client's SDK parses as the store's error; the bytes
of the responses to GET requests are counted (what a process read from the store).

    proxy = S3Proxy(s3_server)            # http://127.0.0.1:<port>
    proxy.fail(r"/__1_0\\.distcp", 403, "AccessDenied", "Access Denied")
    proxy.got_bytes                       # body bytes of GET responses so far
    proxy.stop()
"""

from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade",
        "trailer", "content-length"}


class S3Proxy:
    def __init__(self, upstream: str):
        u = urlsplit(upstream)
        self.host, self.port = u.hostname, u.port
        self.rules: list[tuple[re.Pattern, set[str], int, str, str]] = []
        self.got_bytes = 0
        self.failed: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _any(self) -> None:
                body = self._body()
                rule = proxy._rule(self.command, self.path)
                if rule is not None:
                    status, code, message = rule
                    with proxy._lock:
                        proxy.failed.append(f"{self.command} {self.path}")
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                           f"<Message>{message}</Message><RequestId>proxy</RequestId></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                conn = http.client.HTTPConnection(proxy.host, proxy.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    r = conn.getresponse()
                    data = r.read()
                finally:
                    conn.close()
                if self.command == "GET":
                    with proxy._lock:
                        proxy.got_bytes += len(data)
                self.send_response(r.status, r.reason)
                for k, v in r.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                # A HEAD's length is the object's (its body is empty).
                self.send_header("Content-Length", r.getheader("Content-Length", "0")
                                 if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def fail(self, path_pattern: str, status: int, code: str, message: str,
             methods: tuple[str, ...] = ("PUT", "POST")) -> None:
        """Answer requests of ``methods`` whose path matches ``path_pattern`` (a regex,
        searched) with ``status`` and an S3 error body ``code``/``message``."""
        self.rules.append((re.compile(path_pattern), set(methods), status, code, message))

    def _rule(self, method: str, path: str) -> Optional[tuple[int, str, str]]:
        for pattern, methods, status, code, message in self.rules:
            if method in methods and pattern.search(path):
                return status, code, message
        return None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
