"""A TCP proxy in front of an HTTP/1.1 server that counts the requests going through it.

For the Prefect API: its clients keep connections alive and its events client
upgrades to a websocket, so the proxy reads each request's head and body to find
where the next one starts, and passes an upgraded connection through untouched
(counted once). Responses flow back byte for byte.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from urllib.parse import urlsplit


class RequestCounter:
    """Serves on 127.0.0.1 (`url`), forwarding to `upstream` (`http://host:port[/path]`).

    `requests` counts requests by their path without the query.
    """

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._path = parts.path
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self.url = ""

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.requests.values())

    def __enter__(self) -> RequestCounter:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        )
        self._server = started.result(timeout=10)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}{self._path}"
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        back = asyncio.ensure_future(_pipe(up_reader, writer))
        try:
            await self._requests(reader, up_writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            up_writer.close()
            await asyncio.gather(back, return_exceptions=True)
            writer.close()

    async def _requests(self, reader: asyncio.StreamReader, up: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = {
                name.strip().lower(): value.strip()
                for name, _, value in (line.partition(":") for line in header_lines if line)
            }
            path = request_line.split(" ")[1].split("?")[0] if " " in request_line else "?"
            with self._lock:
                self.requests[path] += 1
            up.write(head)
            if "upgrade" in headers.get("connection", "").lower():
                await _pipe(reader, up)
                return
            if "chunked" in headers.get("transfer-encoding", "").lower():
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";")[0], 16)
                    up.write(size_line + await reader.readexactly(size + 2))
                    if size == 0:
                        break
            else:
                length = int(headers.get("content-length") or 0)
                if length:
                    up.write(await reader.readexactly(length))
            await up.drain()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()
