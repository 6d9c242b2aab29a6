"""Two trees' API side by side: what a change to api/ does to the CPU of a single submit and a
read, measured in one run.

On a machine shared with other work, the CPU a request costs moves by a fifth from one minute to
the next, more than most changes to the API do; two runs of `bench.api_cost` cannot tell them
apart. Here each tree's `sluice api` (`python -m launch.cli api` with `PYTHONPATH` and working
directory the tree) runs at once, each with its own redis-server and registry as
`bench.api_cost` makes them, and the phases alternate between the two, their order flipping each
round: submits and reads of finished jobs at 32 and at 4 connections (`bench.rawhttp` in another
process). Reported: each tree's API CPU ms per request, median (min-max) over rounds, and the
median (min-max) of the per-round ratios, second tree over first.

    python -m bench.api_cost_ab --before DIR [--after DIR] [--rounds 10]

(`git archive <commit> | tar -x -C DIR` makes a tree of a commit.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench import rawhttp
from bench.api_cost import MODEL, VERSION, Stack, bench_tenant, measure, read_requests, redis_pid, submit_requests
from bench.durable_accept import database
from bench.job_progress import finish_jobs
from bench.machine import machine_info
from bench.output import command_line, table, write_json
from bench.processes import REPO, free_port, private_redis, sigterm_as_interrupt, stop_processes
from scheduler.planning.text_mix import skewed_texts

PHASES = (("submit", 32), ("read", 32), ("submit", 4), ("read", 4))


@contextlib.contextmanager
def tree_api(tree: Path, *, redis_url: str, database_url: str, home: Path) -> Iterator[tuple[int, int]]:
    """`sluice api` from `tree`'s code on a free port: (pid, port) once /readyz says 200."""
    import httpx

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(tree), "SLUICE_REDIS_URL": redis_url,
           "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
           "SLUICE_BREAKER_NO_WORKER_GRACE_S": "1e9"}
    with (home / "api.log").open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "api", "--port", str(port)], env=env, cwd=tree,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the API of {tree} did not start; see {home / 'api.log'}")
            time.sleep(0.2)
        yield proc.pid, port
    finally:
        stop_processes([proc])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the first tree")
    parser.add_argument("--after", type=Path, default=REPO, help="the second tree (default this one)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--submits", type=int, default=1500, help="requests per submit phase")
    parser.add_argument("--reads", type=int, default=2000, help="requests per read phase")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    results: dict[tuple[str, str], list[float]] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(sigterm_as_interrupt())
        executor = stack.enter_context(
            ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")))
        stacks: dict[str, tuple[Stack, list[str]]] = {}
        for name, tree in trees.items():
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"sluice-bench-ab-{name}-")))
            redis_base, _ = stack.enter_context(private_redis())
            database_url = stack.enter_context(database())
            redis_url = f"{redis_base}/0"
            key = bench_tenant(database_url, home)
            pid, port = stack.enter_context(tree_api(tree, redis_url=redis_url, database_url=database_url, home=home))
            api = Stack(api_pid=pid, redis_pid=redis_pid(redis_url), port=port, key=key, redis_url=redis_url)
            # The jobs the reads choose from, made final; submitting them warms the submit path up.
            driven = executor.submit(rawhttp.drive, port, submit_requests(key, skewed_texts(1000, seed=5)), 32,
                                     True).result()
            ids = [json.loads(body)["id"] for body in driven.bodies]
            finish_jobs(redis_url, MODEL, VERSION, ids)
            executor.submit(rawhttp.drive, port, read_requests(key, ids, wait=False), 32).result()
            stacks[name] = (api, ids)
        for round_ in range(args.rounds):
            for name in list(trees) if round_ % 2 == 0 else list(trees)[::-1]:
                api, ids = stacks[name]
                for phase, concurrency in PHASES:
                    requests = (submit_requests(api.key, skewed_texts(args.submits, seed=round_)) if phase == "submit"
                                else read_requests(api.key, random.Random(round_).choices(ids, k=args.reads),
                                                   wait=False))
                    result, _ = measure(api, phase, executor.submit(rawhttp.drive, api.port, requests, concurrency),
                                        jobs_per_request=1, concurrency=concurrency)
                    results.setdefault((name, f"{phase}@{concurrency}"), []).append(result["api_ms_per_request"])
                    print(f"round {round_ + 1} {name:<6} {phase}@{concurrency:<2} API "
                          f"{result['api_ms_per_request']:.3f} ms/request, other load "
                          f"{result['other_load_cores']:.2f} cores", flush=True)

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    rows, summary = [], {}
    for phase, concurrency in PHASES:
        label = f"{phase}@{concurrency}"
        before, after = results[("before", label)], results[("after", label)]
        ratios = [a / b for b, a in zip(before, after, strict=True)]
        rows.append([label, cell(before), cell(after), f"{statistics.median(ratios):.2f} "
                                                      f"({min(ratios):.2f}-{max(ratios):.2f})"])
        summary[label] = {"before": before, "after": after, "ratios": ratios}
    host = machine_info()
    print(f"\nAPI CPU ms per request, median (min-max) over {args.rounds} rounds; host: {host['cpu']}, "
          f"{host['cores']} cores")
    print(table(["phase@connections", f"before ({trees['before'].name})", f"after ({trees['after'].name})",
                 "after/before per round"], rows))
    path = write_json("api_cost_ab.json", {
        "command": command_line("bench.api_cost_ab"), "machine": host,
        "trees": {name: str(tree) for name, tree in trees.items()}, "rounds": args.rounds,
        "cpu": "user + system from /proc/<pid>/stat (10 ms ticks), API process", "runs": summary,
    })
    print(f"written: {path}")


if __name__ == "__main__":
    main()
