"""The peer the platform is measured against: one Celery task per request, running the platform's
own MiniLM embedding handler, the way a team without Sluice would serve the model.

    SLUICE_BENCH_CELERY_URL=redis://127.0.0.1:6379/1 OMP_NUM_THREADS=1 \\
        celery -A bench.celery_baseline worker --pool prefork --concurrency 2

Each prefork child loads the model once, in `worker_process_init`, exactly as `sluice worker`
does (`workers.models.handlers.load_handler`: the sha256 checked, one torch thread, warmed up),
and answers the same output a Sluice job stores. The parent process never imports torch, so no
child inherits a torch thread pool across the fork.

Broker and result backend are the Redis at `SLUICE_BENCH_CELERY_URL`, read when Celery first
needs its configuration, not at import. Everything else is Celery's default, what a team starts
with: JSON, a prefetch of 4 tasks per child, acknowledgement on receipt.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from celery import Celery, signals

if TYPE_CHECKING:
    from workers.models.handlers import ModelHandler

URL_ENV = "SLUICE_BENCH_CELERY_URL"
EMBED_TASK = "bench.embed"
TORCH_THREADS = 1


def _config() -> dict[str, Any]:
    url = os.environ[URL_ENV]
    return {"broker_url": url, "result_backend": url, "broker_connection_retry_on_startup": True}


app = Celery("sluice_bench_peer")
app.add_defaults(_config)

_handler: ModelHandler | None = None


def load_minilm() -> ModelHandler:
    """The `minilm` demo version's handler, loaded as a Sluice worker loads it."""
    from sluice.artifacts import MINILM_URI, artifact_sha256, resolve_artifact
    from workers.models.handlers import load_handler

    handler = load_handler(
        kind="embedding",
        artifact=MINILM_URI,
        sha256=artifact_sha256(resolve_artifact(MINILM_URI)),
        device="cpu",
        threads=TORCH_THREADS,
    )
    handler.warmup()
    return handler


@signals.worker_process_init.connect
def _load_in_child(**_: Any) -> None:
    global _handler
    _handler = load_minilm()


@app.task(name=EMBED_TASK)
def embed(text: str) -> dict[str, Any]:
    global _handler
    if _handler is None:  # a pool without worker_process_init (solo, threads)
        _handler = load_minilm()
    return _handler.run([{"text": text}])[0]
