"""Two-stage shutdown: the first SIGTERM or SIGINT calls `stop` (stop intake, drain within the
grace period), any later one calls `force` (leave without draining).

Every long-running process uses it: `sluice up` and `sluice scheduler` through `signal.signal`,
`sluice worker` on its event loop, and `sluice api` from uvicorn's own signal handler, which it
keeps because uvicorn restores the previous handlers and re-raises the signal once it has stopped.
What forcing means is the caller's: `sys.exit(1)`, `os._exit(1)`, or telling uvicorn to stop waiting.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TwoStage:
    """A signal handler that counts signals of either kind: the first calls stop, later ones force."""

    def __init__(self, *, stop: Callable[[], object], force: Callable[[], object]) -> None:
        self._stop = stop
        self._force = force
        self.seen = 0

    def __call__(self, signum: int = 0, frame: FrameType | None = None) -> None:
        self.seen += 1
        if self.seen == 1:
            self._stop()
        else:
            self._force()


def install_two_stage(stop: Callable[[], object], *, force: Callable[[], object],
                      loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Handle SIGTERM and SIGINT in two stages, on `loop` when given, else with `signal.signal`.

    On the loop, both callables run as loop callbacks. Without one, `stop` runs on a thread of its
    own: a signal handler interrupts the main thread between any two bytecodes, perhaps inside a
    lock that `stop` needs (`threading.Event.set` while the main thread is in `wait`). `force`
    still runs in the handler, so `sys.exit` raises in the main thread.
    """
    if loop is not None:
        handler = TwoStage(stop=stop, force=force)
        for sig in SIGNALS:
            loop.add_signal_handler(sig, handler)
        return
    handler = TwoStage(stop=lambda: threading.Thread(target=stop, name="sluice-stop", daemon=True).start(),
                       force=force)
    for sig in SIGNALS:
        signal.signal(sig, handler)
