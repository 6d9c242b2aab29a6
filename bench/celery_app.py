"""What the bench's Celery workers share: the broker and result backend they read from the
environment, the task names their clients send by, and the wait until every prefork child is
ready.

A worker module builds its app with `make_app`; the parent must not import torch (no child may
inherit a torch thread pool across the fork), so models load in `worker_process_init`. Two
worker modules answer the same task names on different Redis DBs, and one client serves both.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

URL_ENV = "SLUICE_BENCH_CELERY_URL"
EMBED_TASK = "bench.embed"
PID_TASK = "bench.child_pid"
TORCH_THREADS = 1


def _config() -> dict[str, Any]:
    url = os.environ[URL_ENV]
    return {"broker_url": url, "result_backend": url, "broker_connection_retry_on_startup": True}


def _child_pid() -> int:
    """Which child ran this: a child takes tasks only once its model is loaded."""
    return os.getpid()


def make_app(name: str) -> Celery:
    """An app whose broker and result backend are the Redis at `URL_ENV`, read when Celery first
    needs its configuration, not at import; everything else is Celery's default."""
    app = Celery(name)
    app.add_defaults(_config)
    app.task(name=PID_TASK)(_child_pid)
    return app


def wait_children(url: str, children: int, check_alive: Callable[[], None], timeout_s: float = 180.0) -> None:
    """Until each of the `children` of the worker on `url` has answered a task. The probe is an
    app of its own, so one process can wait on workers behind different brokers."""
    from celery.exceptions import TimeoutError as CeleryTimeout

    probe = Celery("sluice_bench_probe", broker=url, backend=url)
    deadline = time.monotonic() + timeout_s
    answered: set[int] = set()
    try:
        while len(answered) < children:
            check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(answered)} of {children} Celery children on {url} ready after {timeout_s:.0f}s"
                )
            for result in [probe.send_task(PID_TASK) for _ in range(2 * children)]:
                with contextlib.suppress(CeleryTimeout):
                    answered.add(int(result.get(timeout=5.0)))
            time.sleep(0.2)
    finally:
        probe.close()
