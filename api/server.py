"""Serving the app with uvicorn and a two-stage shutdown.

First SIGTERM (or SIGINT): the replica starts draining at once: `/readyz` turns 503 so the load
balancer stops sending, new submissions get 503 with `Retry-After`, long-polls and event streams
end with the job's current state; uvicorn stops accepting connections and waits up to the grace
period for requests in flight. A second signal, of either kind, exits without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from sluice.shutdown import TwoStage

log = logging.getLogger(__name__)

# Allocations (less deallocations) of tracked objects between young-generation collections.
YOUNG_GC_THRESHOLD = 10_000


class TwoStageServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, *, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app
        self._signals = TwoStage(stop=self._start_draining, force=self._stop_waiting)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # Everything alive now (the modules, the app, its caches and pools) lives as long as the
        # process: out of the collector's sight, a full collection no longer walks it. Those
        # walks were about a fifth of a submission's CPU (py-spy, bench.api_cost).
        gc.collect()
        gc.freeze()
        # A young collection every 700 allocations ran several times per request; the objects a
        # request makes die with it, so collecting less often costs little memory (bench.api_cost).
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn installs this handler itself (it restores the previous ones once stopped and
        # raises the recorded signal again), so the stages are counted here, not installed.
        self._signals(sig, frame)
        if not self.force_exit:
            super().handle_exit(sig, frame)

    def _start_draining(self) -> None:
        log.info("draining: refusing new jobs, finishing requests in flight")
        # A signal handler may interrupt the loop anywhere: change loop state from a callback.
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(self._drain)

    def _stop_waiting(self) -> None:
        log.warning("second signal: exiting without waiting for requests in flight")
        self.force_exit = True

    def _drain(self) -> None:
        state = getattr(self._app.state, "sluice", None)
        if state is not None:
            state.draining.set()
            state.hub.wake_all()


# How long an idle keep-alive connection stays open. The shipped client lets its own idle
# connections go sooner (`sluice_client.client.KEEPALIVE_EXPIRY_S`), so that it never sends a
# request on a connection this server is closing.
KEEP_ALIVE_S = 5


def serve(app: FastAPI, *, host: str, port: int, grace_s: float) -> None:
    # Named, not "auto": without uvloop or httptools uvicorn silently falls back to pure-Python
    # equivalents that cost each request more CPU; a missing one should fail at start-up instead.
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, loop="uvloop",
                            http="httptools", timeout_graceful_shutdown=int(grace_s),
                            timeout_keep_alive=KEEP_ALIVE_S)
    TwoStageServer(config, app=app).run()
