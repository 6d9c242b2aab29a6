"""What a client process spends per job: the shipped Python client's `run` against `sluice up`,
and Celery's `apply_async().get()` against a Celery worker, one job at a time.

A job is one MiniLM embedding of a skewed-mix text, so both clients send the same input and
decode an answer of the same size (384 floats). Sluice is the real platform
(`bench.up_platform.running_up`); Celery is `bench.celery_baseline` (the platform's own MiniLM
handler, 2 prefork children, broker and result backend on a private redis-server, Celery's
defaults otherwise), started the way `bench.celery_peer` starts it. Each measurement is a fresh
client process (`--client`, this module again, the worktree's `sluice_client` first on its path):
it makes its client, sends `--warmup` jobs, then `--jobs` jobs one after another and reports
`time.process_time()` (user + system of the whole process, its threads included) over those
jobs. The systems alternate over `--repeats`; each figure is the median (min-max) over repeats.
Only the client's CPU is compared: the servers' latencies differ and are shown as context.

    python -m bench.client_cost [--repeats 3] [--jobs 200]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.celery_app import URL_ENV, wait_children
from bench.machine import machine_info
from bench.output import command_line, fmt, table, write_json
from bench.processes import REPO, private_redis, sigterm_as_interrupt, stop_processes
from bench.up_platform import running_up
from scheduler.planning.text_mix import skewed_texts

MODEL = "minilm"
SYSTEMS = ("sluice", "celery")


# --- the client process ----------------------------------------------------------------------------


def sluice_jobs(url: str, key: str, texts: list[str], warmup: int) -> tuple[float, float]:
    from sluice_client import SluiceClient

    with SluiceClient(base_url=url, api_key=key) as client:
        for text in texts[:warmup]:
            client.run(MODEL, {"text": text})
        cpu, wall = time.process_time(), time.perf_counter()
        for text in texts[warmup:]:
            job = client.run(MODEL, {"text": text})
            if job["status"] != "succeeded":
                raise RuntimeError(f"a job ended {job['status']}")
        return time.process_time() - cpu, time.perf_counter() - wall


def celery_jobs(url: str, texts: list[str], warmup: int) -> tuple[float, float]:
    os.environ[URL_ENV] = url
    from bench.celery_baseline import embed

    for text in texts[:warmup]:
        embed.apply_async((text,)).get(timeout=60)
    cpu, wall = time.process_time(), time.perf_counter()
    for text in texts[warmup:]:
        embed.apply_async((text,)).get(timeout=60)
    return time.process_time() - cpu, time.perf_counter() - wall


def client_main(args: argparse.Namespace) -> None:
    texts = skewed_texts(args.warmup + args.jobs, seed=args.seed)
    if args.client == "sluice":
        cpu_s, wall_s = sluice_jobs(args.url, args.key, texts, args.warmup)
    else:
        cpu_s, wall_s = celery_jobs(args.url, texts, args.warmup)
    print(json.dumps({"cpu_s": cpu_s, "wall_s": wall_s, "jobs": args.jobs}))


# --- the orchestrator ------------------------------------------------------------------------------


@contextlib.contextmanager
def celery_worker() -> Iterator[str]:
    """A Celery worker running `bench.celery_baseline` on a private redis-server; answers its URL
    once each child has answered a task (a child takes none before its model is loaded)."""
    from bench import celery_peer

    with private_redis() as (base, _), tempfile.TemporaryDirectory(prefix="sluice-bench-celery-") as tmp:
        url = f"{base}/1"
        proc = celery_peer.celery_worker(Path(tmp), url)

        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"the Celery worker exited with {proc.returncode}; see {tmp}/logs")

        try:
            wait_children(url, celery_peer.CELERY_CHILDREN, alive)
            yield url
        finally:
            stop_processes([proc])


def one_client(system: str, *, url: str, key: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "clients" / "python"), str(REPO)]))
    out = subprocess.run(
        [sys.executable, "-m", "bench.client_cost", "--client", system, "--url", url, "--key", key,
         "--jobs", str(args.jobs), "--warmup", str(args.warmup), "--seed", str(seed)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{system} client failed:\n{out.stderr[-3000:]}")
    result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    return {"system": system, "client_ms_per_job": result["cpu_s"] * 1000 / result["jobs"],
            "wall_ms_per_job": result["wall_s"] * 1000 / result["jobs"], **result}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=200, help="measured jobs per client process")
    parser.add_argument("--warmup", type=int, default=20, help="jobs each client sends before measuring")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--key", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args)
        return

    runs: list[dict[str, Any]] = []
    with sigterm_as_interrupt(), running_up() as up, celery_worker() as celery_url:
        urls = {"sluice": up.api_url, "celery": celery_url}
        for repeat in range(args.repeats):
            for system in SYSTEMS if repeat % 2 == 0 else reversed(SYSTEMS):
                result = one_client(system, url=urls[system], key=up.key, args=args, seed=args.seed + repeat)
                result["repeat"] = repeat + 1
                runs.append(result)
                print(f"repeat {repeat + 1} {system:<6} client {result['client_ms_per_job']:.3f} ms CPU/job, "
                      f"{result['wall_ms_per_job']:.1f} ms/job wall", flush=True)
    summary = {
        system: {name: spread([run[name] for run in runs if run["system"] == system])
                 for name in ("client_ms_per_job", "wall_ms_per_job")}
        for system in SYSTEMS
    }
    host = machine_info()
    print(f"\nClient process CPU per job, one job at a time, median (min-max) over {args.repeats} client processes "
          f"of {args.jobs} jobs; host: {host['cpu']}, {host['cores']} cores")
    print(table(["client", "CPU ms per job", "wall ms per job (context)"],
                [[system, f"{fmt(s['client_ms_per_job']['median'], 3)} ({fmt(s['client_ms_per_job']['min'], 3)}-"
                          f"{fmt(s['client_ms_per_job']['max'], 3)})",
                  f"{fmt(s['wall_ms_per_job']['median'], 1)} ({fmt(s['wall_ms_per_job']['min'], 1)}-"
                  f"{fmt(s['wall_ms_per_job']['max'], 1)})"]
                 for system, s in summary.items()]))
    path = write_json("client_cost.json", {
        "command": command_line("bench.client_cost"), "machine": host, "jobs": args.jobs, "warmup": args.warmup,
        "repeats": args.repeats, "cpu": "time.process_time() of the client process over the measured jobs",
        "summary": summary, "runs": runs,
    })
    print(f"written: {path}")


if __name__ == "__main__":
    main()
