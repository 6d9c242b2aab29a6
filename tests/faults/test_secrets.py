"""A secret planted in an input never reaches a log or a metric label (sluice/redact.py; ARCHITECTURE, "Logs").

The inputs carry an email address, a card number and a unique marker string (which no redaction
pattern could recognise, so only never logging inputs keeps it out). They go through the API and
a real worker, in a batch with a poison input so the error path (bisection, its warning) runs too.
Checked: every log record of the in-process API (and of everything else in this process) at
DEBUG, the worker's whole log file, and `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from launch.seed import Seeded
from tests.support import wait_job

pytestmark = pytest.mark.slow


def test_planted_secrets_never_reach_logs_or_metrics(
    api: Any, demo: httpx.Client, seeded: Seeded, register_synthetic: Callable[..., str],
    start_worker: Callable[..., Any], caplog: pytest.LogCaptureFixture, figure: Callable[[str, object], None],
) -> None:
    marker = f"MARKER-{secrets.token_hex(12)}"
    email = f"jane.{secrets.token_hex(4)}@example-{secrets.token_hex(3)}.com"
    card = "4111 1111 1111 1111"
    card_digits = card.replace(" ", "")
    model = register_synthetic("secrets", max_batch_size=16, max_wait_ms=50)
    caplog.set_level(logging.DEBUG)

    text = f"please charge card {card} for {email}, reference {marker}"
    inputs: list[dict[str, Any]] = [{"text": f"{text} #{i}"} for i in range(6)]
    inputs.insert(3, {"text": "__poison__"})  # fails its batch; bisection isolates it and logs why
    # A request id that is not a plain token (here, an address) is replaced, never echoed or logged.
    response = demo.post(f"/v1/models/{model}/jobs:bulk", json={
        "inputs": inputs, "metadata": {"note": marker, "contact": email},
        "callback_url": f"https://hooks.example.com/sluice?token={marker}",
    }, headers={"X-Request-Id": email})
    assert response.status_code == 202, response.text
    assert response.headers["X-Request-Id"].startswith("req_"), response.headers
    ids = response.json()["ids"]
    # One more through the single-job route, with the secrets in the Idempotency-Key's body too.
    response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": text}, "metadata": {"m": marker}},
                         headers={"Idempotency-Key": f"idem-{secrets.token_hex(4)}"})
    assert response.status_code == 202, response.text
    ids.append(response.json()["id"])
    # Refusals that could quote the input: unknown field, wrong type, too long.
    refused = [
        demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": text, marker: email}}),
        demo.post(f"/v1/models/{model}/jobs", json={"input": {"tokens": f"{marker} {card}"}}),
        demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": (text + " ") * 400}}),
        demo.post(f"/v1/models/{model}/jobs", json={"input": text}),
    ]
    assert [r.status_code for r in refused] == [422] * 4, [r.text for r in refused]

    worker = start_worker(model)
    jobs = [wait_job(demo, job_id, timeout_s=60) for job_id in ids]
    statuses = [job["status"] for job in jobs]
    assert statuses.count("failed") == 1 and statuses[3] == "failed", statuses
    assert statuses.count("succeeded") == len(ids) - 1, statuses
    assert "poison" in jobs[3]["error"]["message"]
    metrics = demo.get("/metrics").text
    # Let the worker write what it writes at shutdown (drain) too before reading its log.
    assert worker.terminate() == 0
    worker_log = worker.log_path.read_text(errors="replace")
    assert f"job {ids[3]} failed" in worker_log, worker_log[-2000:]  # the error path did log

    # The capture sees the API's thread: a record logged on the API's own event loop arrives.
    async def canary() -> None:
        logging.getLogger("api.canary").debug("canary from the API loop")

    asyncio.run_coroutine_threadsafe(canary(), api.loop).result(timeout=5)
    assert any(r.getMessage() == "canary from the API loop" for r in caplog.records)

    api_log = []
    for record in caplog.records:
        api_log.append(record.getMessage())
        api_log.append(repr(record.args))
        if record.exc_text:
            api_log.append(record.exc_text)
        if record.exc_info:
            api_log.append(logging.Formatter().formatException(record.exc_info))
    api_text = caplog.text + "\n".join(api_log)
    figure("api_log_records", len(caplog.records))
    figure("worker_log_lines", worker_log.count("\n"))

    forbidden = {"marker": marker, "email": email, "card": card, "card digits": card_digits,
                 "demo key": seeded.demo_key}
    for where, text_seen in (("API log", api_text), ("worker log", worker_log), ("/metrics", metrics)):
        leaked = [name for name, value in forbidden.items() if value in text_seen]
        assert not leaked, f"{where} carries the {', '.join(leaked)}"
