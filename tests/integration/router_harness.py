"""The router app served by uvicorn on a free loopback port, in a thread of the test process,
exactly as `controlplane serve` serves it (`RouterHttpServer`: the guarded HTTP protocol).

    with RouterServer(settings) as router:
        OpenAI(base_url=f"{router.url}/v1", api_key="x")
        router.runtime.ledger            # the live objects, for leak checks (read only)

Teardown stops uvicorn (lifespan shutdown closes the fleet, index and followers) and checks the
thread ended.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import TracebackType
from typing import Any

import httpx

from router.config import RouterSettings
from router.http.server import RouterHttpServer
from router.http.service import create_app
from router.runtime import RouterRuntime


class RouterServer:
    def __init__(self, settings: RouterSettings, *, ready_timeout_s: float = 20.0) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self.http = RouterHttpServer(settings, self.app, host="127.0.0.1", port=0)
        self.server = self.http.server
        self.thread = threading.Thread(target=self._run, name="router", daemon=True)
        self.ready_timeout_s = ready_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""
        self.metrics_url = ""

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.http.serve())
        self.loop.close()

    @property
    def runtime(self) -> RouterRuntime:
        rt: RouterRuntime = self.app.state.runtime
        return rt

    def call(self, fn: Any, timeout_s: float = 10.0) -> Any:
        """Run `fn()` (sync, or returning an awaitable) on the router's loop; its result."""
        assert self.loop is not None

        async def wrapper() -> Any:
            out = fn()
            if asyncio.iscoroutine(out):
                out = await out
            return out

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout_s)

    def start(self) -> RouterServer:
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the router did not start")
            time.sleep(0.02)
        ports = self.http.ports
        self.url = f"http://127.0.0.1:{ports['main']}"
        if "metrics" in ports:  # telemetry.metrics_port: /metrics on a listener of its own
            self.metrics_url = f"http://127.0.0.1:{ports['metrics']}"
        return self

    def wait_ready(self, replicas: int, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/ready", timeout=2.0)
            if r.status_code == 200 and r.json()["ready_replicas"] >= replicas:
                return
            time.sleep(0.05)
        raise AssertionError(f"router not ready with {replicas} replicas: {r.text}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15.0)
        assert not self.thread.is_alive(), "the router thread did not stop"

    def __enter__(self) -> RouterServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
