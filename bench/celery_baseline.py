"""The peer the platform is measured against: one Celery task per request, running the platform's
own MiniLM embedding handler, the way a team without Sluice would serve the model.

    SLUICE_BENCH_CELERY_URL=redis://127.0.0.1:6379/1 OMP_NUM_THREADS=1 \\
        celery -A bench.celery_baseline worker --pool prefork --concurrency 2

Each prefork child loads the model once, in `worker_process_init`, exactly as `sluice worker`
does (`workers.models.loading.load_handler`: the artifact and sha256 of the Sluice version it is
compared with, from `SLUICE_BENCH_ARTIFACT` / `SLUICE_BENCH_SHA256`, the sha256 checked, the
same precision policy, one torch thread, warmed up), and answers the output a Sluice job stores.
The parent process never imports torch, so no child inherits a torch thread pool across the fork.

Broker and result backend are the Redis at `SLUICE_BENCH_CELERY_URL` (`bench.celery_app`).
Everything else is Celery's default, what a team starts with: JSON, a prefetch of 4 tasks per
child, acknowledgement on receipt.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from celery import signals

from bench.celery_app import EMBED_TASK, TORCH_THREADS, make_app

if TYPE_CHECKING:
    from workers.models.protocol import ModelHandler

ARTIFACT_ENV, SHA256_ENV = "SLUICE_BENCH_ARTIFACT", "SLUICE_BENCH_SHA256"

app = make_app("sluice_bench_peer")

_handler: ModelHandler | None = None


def load_minilm() -> ModelHandler:
    """The handler a `sluice worker` builds for the version named by the environment (by default
    the demo `minilm` artifact)."""
    from sluice.artifacts import MINILM_URI, artifact_sha256, resolve_artifact
    from workers.models.loading import load_handler
    from workers.models.precision import PrecisionPolicy

    artifact = os.environ.get(ARTIFACT_ENV, MINILM_URI)
    sha256 = os.environ.get(SHA256_ENV) or artifact_sha256(resolve_artifact(artifact))
    handler = load_handler(
        kind="embedding",
        artifact=artifact,
        sha256=sha256,
        device="cpu",
        threads=TORCH_THREADS,
        precision=PrecisionPolicy(),
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
