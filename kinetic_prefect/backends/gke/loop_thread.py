"""An asyncio event loop on a daemon thread of its own, driven from synchronous code.

Owns starting the loop on first use, running coroutines on it from other threads
(and refusing to from the loop's own thread, which would deadlock), the tasks
spawned on it, and stopping it: those tasks are cancelled and a final coroutine
runs before the loop closes. The gke backend makes every API call on one of these.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """A private event loop for a synchronous object.

    Example:
        ```python
        runtime = LoopThread("my-loop", on_shutdown=client.close)
        runtime.start()
        result = runtime.call(fetch())
        runtime.stop()
        ```
    """

    def __init__(self, name: str, on_shutdown: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self.tasks: set[asyncio.Task[Any]] = set()
        self._on_shutdown = on_shutdown
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._loop is not None

    def start(self) -> None:
        """Start the loop's thread, unless it runs already."""
        with self._lock:
            if self._loop is not None:
                return
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._run, args=(loop,), name=self.name, daemon=True
            )
            self._loop = loop
            self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (from any other thread)."""
        assert self._loop is not None
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Backend calls must not be made from its own event loop.")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> None:
        """Run `coro` as a task of the loop, cancelled when it stops (call on the loop)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def stop(self) -> None:
        """Stop the loop after its tasks are cancelled and `on_shutdown` has run."""
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shutdown())
            loop.close()

    async def _shutdown(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await self._on_shutdown()
