"""An HTTP proxy on 127.0.0.1 in front of an S3 server that injects the faults an object
store delivers: for chosen requests (a method and a key pattern, the first N matches) it
answers ``503 SlowDown`` with S3's XML error body, delays the request, or accepts it and
never answers (a stalled connection). Everything else is forwarded as it came, bodies
streamed both ways: ``Content-Length`` and chunked (``aws-chunked`` included) uploads
byte for byte, ``Range`` reads and their ``206`` answers unchanged.

    proxy = S3FaultProxy("http://127.0.0.1:5000").start()
    proxy.add("PUT", r"^ckpt/.*\\.distcp$", "slowdown", times=2)
    ...  # clients use proxy.endpoint as their AWS_ENDPOINT_URL
    proxy.count("PUT", r"\\.distcp$")   # requests seen (faulted ones included)
    proxy.stop()

Path-style addressing only (``/<bucket>/<key>``): what clients use with an endpoint
on an IP address. A standard-library server (``http.server``, ``http.client``), one
thread per connection; a test helper, not a production proxy.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import unquote, urlsplit

# Headers that belong to one connection, not to the request (RFC 9110 7.6.1); the
# proxy frames each hop itself. Transfer-Encoding is handled explicitly.
_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
        "proxy-authorization", "te", "trailer", "upgrade", "transfer-encoding"}
_CHUNK = 64 * 1024
ACTIONS = ("slowdown", "stall", "delay")


def slowdown_body(key: str) -> bytes:
    """The XML body S3 sends with ``503 SlowDown``."""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            f"<Message>Please reduce your request rate.</Message><Key>{key}</Key>"
            f"<RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>").encode()


@dataclass
class Rule:
    """Requests with ``method`` (``*``: any) whose key matches ``key`` (``re.search``) get
    ``action`` the first ``times`` times they come (``times=None``: always).
    ``seconds``: a ``delay``'s length, or how long a ``stall`` holds the connection at
    most (it is released at ``stop()``)."""

    method: str
    key: str
    action: str
    times: Optional[int] = 1
    seconds: float = 0.0
    hits: int = 0

    def take(self, method: str, key: str) -> bool:
        if self.method not in ("*", method) or not re.search(self.key, key):
            return False
        if self.times is not None and self.hits >= self.times:
            return False
        self.hits += 1
        return True


@dataclass
class Seen:
    """One request the proxy received: when, what, and what it did (``forward`` or the
    rule's action) and the status sent (None for a stall)."""

    t: float
    method: str
    bucket: str
    key: str
    action: str
    status: Optional[int] = None
    headers: dict = field(default_factory=dict)


class S3FaultProxy:
    """The proxy (see the module's docstring). ``upstream``: the S3 server's URL."""

    def __init__(self, upstream: str, upstream_timeout_s: float = 60.0):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port or 80)
        self.upstream_timeout_s = upstream_timeout_s
        self.rules: list[Rule] = []
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._server: Optional[ThreadingHTTPServer] = None
        self._listeners: list = []

    # ------------------------------------------------------------------ control
    def start(self) -> "S3FaultProxy":
        handler = type("Handler", (_Handler,), {"proxy": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True).start()
        return self

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, method: str, key: str, action: str, times: Optional[int] = 1,
            seconds: float = 0.0) -> Rule:
        """A fault for the next ``times`` requests of ``method`` whose key matches the
        regular expression ``key``. Rules are tried in the order added."""
        if action not in ACTIONS:
            raise ValueError(f"action {action!r}: one of {ACTIONS}")
        rule = Rule(method.upper(), key, action, times, seconds)
        with self._lock:
            self.rules.append(rule)
        return rule

    def on_request(self, fn) -> None:
        """Call ``fn(seen)`` as each request arrives (before it is forwarded or faulted),
        in the proxy's thread: a test's trigger (e.g. kill a worker at the first PUT of
        a checkpoint's shard). ``fn`` must be quick."""
        self._listeners.append(fn)

    def reset(self) -> None:
        """No rules, no listeners, nothing seen; stalled connections released."""
        with self._lock:
            self.rules.clear()
            self.seen.clear()
            self._listeners.clear()
        self._released.set()
        self._released = threading.Event()

    def count(self, method: str = "*", key: str = "", action: Optional[str] = None) -> int:
        """Requests seen of ``method`` with a key matching ``key`` (and, given, ``action``)."""
        with self._lock:
            return sum(1 for s in self.seen if method.upper() in ("*", s.method)
                       and re.search(key, s.key) and action in (None, s.action))

    def stop(self) -> None:
        self._released.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ------------------------------------------------------------------ internals
    def _decide(self, method: str, bucket: str, key: str, headers) -> tuple[Seen, Optional[Rule]]:
        with self._lock:
            rule = next((r for r in self.rules if r.take(method, key)), None)
            seen = Seen(time.time(), method, bucket, key, rule.action if rule else "forward",
                        headers={k.lower(): v for k, v in headers.items()})
            self.seen.append(seen)
            listeners = list(self._listeners)
        for fn in listeners:
            fn(seen)
        return seen, rule


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
    proxy: S3FaultProxy

    def log_message(self, *args) -> None:  # quiet: the test reads proxy.seen
        pass

    def do_GET(self):
        self._handle()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

    # ------------------------------------------------------------------ one request
    def _handle(self) -> None:
        path = urlsplit(self.path).path
        bucket, _, key = path.lstrip("/").partition("/")
        seen, rule = self.proxy._decide(self.command, bucket, unquote(key), self.headers)
        if rule is not None and rule.action == "stall":
            # Accepted, never answered: hold the connection until released, then drop it.
            self.proxy._released.wait(rule.seconds or 600)
            self.close_connection = True
            return
        if rule is not None and rule.action == "slowdown":
            self._drain_body()
            body = slowdown_body(unquote(key))
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            seen.status = 503
            return
        if rule is not None and rule.action == "delay":
            time.sleep(rule.seconds)
        seen.status = self._forward()

    def _chunked(self) -> bool:
        return "chunked" in self.headers.get("Transfer-Encoding", "").lower()

    def _body_pieces(self):
        """The request body as it arrives, in pieces: ``Content-Length`` bytes, or the
        chunked framing itself (size lines, data, trailers) byte for byte."""
        if self._chunked():
            while True:
                line = self.rfile.readline(65537)
                yield line
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers up to the empty line
                        t = self.rfile.readline(65537)
                        yield t
                        if t in (b"\r\n", b"\n", b""):
                            return
                left = size + 2  # the data and its CRLF
                while left:
                    piece = self.rfile.read(min(_CHUNK, left))
                    if not piece:
                        return
                    left -= len(piece)
                    yield piece
        else:
            left = int(self.headers.get("Content-Length") or 0)
            while left:
                piece = self.rfile.read(min(_CHUNK, left))
                if not piece:
                    return
                left -= len(piece)
                yield piece

    def _drain_body(self) -> None:
        for _ in self._body_pieces():
            pass

    def _forward(self) -> int:
        conn = http.client.HTTPConnection(*self.proxy.upstream, timeout=self.proxy.upstream_timeout_s)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                # Expect: 100-continue was answered to the client already (http.server).
                if k.lower() not in _HOP and k.lower() != "expect":
                    conn.putheader(k, v)
            if self._chunked():
                conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            for piece in self._body_pieces():
                conn.send(piece)
            resp = conn.getresponse()
            self.send_response(resp.status, resp.reason)
            length = resp.getheader("Content-Length")
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
            rechunk = length is None and not no_body
            if rechunk:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if not no_body:
                while True:
                    piece = resp.read(_CHUNK)
                    if not piece:
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if rechunk else piece)
                if rechunk:
                    self.wfile.write(b"0\r\n\r\n")
            return resp.status
        finally:
            conn.close()
