"""The single-job client of the peer bench, one process per measured phase, so its CPU is its own.

Every request submits ONE job and waits for ITS result, as a user's request handler would:

* Sluice: the project's `AsyncClient` on one asyncio loop (one shared connection pool):
  `await client.run(model, input, timeout_s=...)`, which submits and waits in one request
  (`POST …/jobs?wait=`) and long-polls only if the job outlives that wait. A 429 is honoured
  like a polite client: wait `RETRY_AFTER_S`, submit again (counted). The time of acceptance is
  the job's own `enqueued_at` (the same host's clock).
* Celery: `embed.delay(text)` then `AsyncResult.get()` (the Redis result backend's pub/sub), each
  request in a thread of a pool, driven from the same asyncio loop and the same timetables.

`spec["pool"]` bounds both alike: the AsyncClient's connections, the Celery client's threads.

Two load shapes: `open` (a Poisson timetable fixed in advance, `bench.load.open_loop`; latency
counts from the scheduled send time) and `closed` (`concurrency` clients, each sending its next
job when the last one's result is in: the saturation run).

Protocol with `bench.celery_peer`: the spec is a JSON argument; the client connects and runs a
few unmeasured jobs, prints `ready`, waits for a line on stdin, runs the phase, writes its
records to `spec["output"]` and prints `done`. The measured window is between the two.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

from bench.load import Sent, open_loop, poisson_timetable
from scheduler.planning.text_mix import skewed_texts
from sluice_client import AsyncClient, ClientError

RETRY_AFTER_S = 1.0  # the API's smallest Retry-After
WARMUP_JOBS = 16
# Record columns: what the orchestrator reads back.
# batch_size: of the batch the job ran in (Sluice's job resource; 1 for Celery).
COLUMNS = ("index", "scheduled_at", "sent_at", "accepted_at", "done_at", "status", "refused", "batch_size", "error")

Send = Callable[[int], Awaitable[dict[str, Any]]]


async def closed_loop(n: int, concurrency: int, send: Send) -> list[Sent]:
    """`concurrency` clients, each sending job i+1 once job i's result is in, until `n` are done."""
    records: list[Sent] = []
    indices = iter(range(n))

    async def client() -> None:
        for i in indices:  # shared: each index is taken by one client
            record = Sent(index=i, scheduled_at=time.time())
            record.sent_at = record.scheduled_at
            try:
                record.result = await send(i)
            except Exception as exc:  # recorded, the run goes on
                record.error = f"{type(exc).__name__}: {exc}"
            record.answered_at = time.time()
            records.append(record)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


def _sluice_sender(client: AsyncClient, spec: dict[str, Any], texts: Sequence[str]) -> Send:
    async def send(i: int) -> dict[str, Any]:
        refused = 0
        while True:
            try:
                final = await client.run(spec["model"], {"text": texts[i]}, timeout_s=spec["timeout_s"])
                break
            except ClientError as exc:
                if exc.status != 429:
                    raise
                refused += 1
                await asyncio.sleep(RETRY_AFTER_S)
        accepted_at = datetime.fromisoformat(final["timings"]["enqueued_at"]).timestamp()
        ok = final["status"] == "succeeded" and final["output"]["dim"] == len(final["output"]["embedding"])
        return {
            "accepted_at": accepted_at,
            "status": final["status"] if ok else "bad_output",
            "refused": refused,
            "batch_size": (final.get("batch") or {}).get("size"),
        }

    return send


def _celery_sender(pool: ThreadPoolExecutor, spec: dict[str, Any], texts: Sequence[str]) -> Send:
    from bench.celery_baseline import embed

    def blocking(i: int) -> dict[str, Any]:
        result = embed.delay(texts[i])
        accepted_at = time.time()
        output = result.get(timeout=spec["timeout_s"])
        ok = output["dim"] == len(output["embedding"])
        return {
            "accepted_at": accepted_at,
            "status": "succeeded" if ok else "bad_output",
            "refused": 0,
            "batch_size": 1,
        }

    async def send(i: int) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(pool, blocking, i)

    return send


async def _phase(spec: dict[str, Any], send: Send, warm_send: Send) -> tuple[list[Sent], float]:
    """The phase's records and this process's CPU seconds over it (a check on the orchestrator's
    reading of /proc)."""
    await closed_loop(WARMUP_JOBS, 4, warm_send)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    cpu0 = time.process_time()
    if spec["mode"] == "open":
        records = await open_loop(poisson_timetable(spec["rate"], spec["n"], seed=spec["seed"]), send)
    else:
        records = await closed_loop(spec["n"], spec["concurrency"], send)
    return records, time.process_time() - cpu0


async def run(spec: dict[str, Any]) -> tuple[list[Sent], float]:
    texts = skewed_texts(spec["n"], seed=spec["seed"])
    warm_texts = skewed_texts(WARMUP_JOBS, seed=spec["seed"] + 10_000)
    if spec["system"] == "sluice":
        async with AsyncClient(
            base_url=spec["api_url"], api_key=spec["api_key"], timeout_s=spec["timeout_s"],
            max_connections=spec["pool"], retries=0,  # the sender waits out a 429 itself, to count it
        ) as client:
            return await _phase(spec, _sluice_sender(client, spec, texts), _sluice_sender(client, spec, warm_texts))
    with ThreadPoolExecutor(max_workers=spec["pool"], thread_name_prefix="celery-client") as pool:
        return await _phase(spec, _celery_sender(pool, spec, texts), _celery_sender(pool, spec, warm_texts))


def _row(record: Sent) -> list[Any]:
    fields = {
        "index": record.index,
        "scheduled_at": record.scheduled_at,
        "sent_at": record.sent_at,
        "done_at": record.answered_at,
        "status": "error",
        "refused": 0,
        "error": record.error,
        **(record.result or {}),
    }
    return [fields.get(column) for column in COLUMNS]


def main() -> None:
    spec = json.loads(sys.argv[1])
    records, cpu_s = asyncio.run(run(spec))
    rows = [_row(r) for r in records]
    with open(spec["output"], "w") as sink:
        json.dump({"columns": COLUMNS, "rows": rows, "process_cpu_s": cpu_s}, sink)
    sys.stdout.write("done\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
