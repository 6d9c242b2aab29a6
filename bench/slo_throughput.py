"""Throughput within a latency budget: the highest offered rate whose p99 stays under
`--budget-ms`, for Sluice and two Celery peers, in one run.

* **sluice**: the platform as a user runs it (`bench.celery_peer.both_systems`: `sluice api` and 2
  `sluice worker` processes x 1 thread for `minilm` v1), the client `POST …/jobs?wait=`.
* **plain_celery**: the worker a team would write (`bench.celery_transformers`): Hugging Face
  `transformers.AutoModel`, fp32, mean pooling, one task per request, prefork x 2, 1 torch thread.
* **celery_sluice_handler**: the same Celery set-up running Sluice's own MiniLM handler
  (`bench.celery_baseline`) over the artifact Sluice runs, so at the same `--precision`.

One private redis-server: Sluice on DB 0, the two Celery brokers on DBs 1 and 2. Every step of the
ramp of `--rates` runs each peer in turn (the order reversed every other repeat), one fresh client
process per step (`bench.peer_client`) over the same texts (the skewed mix) and the same Poisson
timetable; latency from the scheduled send time to the client holding the final result.

A peer's SLO rate in a repeat is the highest rate of the ramp *before* its first step over the
budget (p99 above it, fewer than 300 samples, or a failed request): what it sustains as the
load grows, not a lucky step above a miss. Once a peer has missed, `--steps-past-miss` more
of its steps are measured (for the plot) and the rest of its ramp is skipped. The CPU per job of
each process group (from /proc utime + stime) is taken at that rate.

On a shared machine one busy neighbour decides a ramp (its first miss ends it), so a step during
which other processes took more than `--max-other-load` cores, or that began while the machine was
that busy (`--quiet-wait` ran out), is measured again, up to `--busy-retries` times; the attempts
set aside stay in the JSON.

Run: ``python -m bench.slo_throughput [--repeats 3] [--precision fp32]``; ``--quick`` for a smoke
check (~3 min on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.celery_app import wait_children
from bench.celery_peer import CELERY_CHILDREN, Stack, both_systems, celery_worker, run_phase
from bench.machine import machine_info, wait_quiet
from bench.output import PERCENTILE_METHOD, RESULTS_DIR, command_line, fmt, table, write_json
from bench.peer_report import progress_line, spread
from bench.processes import sigterm_as_interrupt, stop_processes
from scheduler.planning.text_mix import SKEWED
from sluice.artifacts import MINILM_URI

PEERS = ("sluice", "plain_celery", "celery_sluice_handler")
LABELS = {
    "sluice": "Sluice (API + workers)",
    "plain_celery": "plain Celery (transformers fp32)",
    "celery_sluice_handler": "Celery + Sluice's handler",
}
# Which client drives a peer (`bench.peer_client`), and so which groups serve it (`phase_report`).
CLIENT = {"sluice": "sluice", "plain_celery": "celery", "celery_sluice_handler": "celery"}
# The figures per job kept for a peer, from `phase_report`'s process groups; the API only Sluice's.
GROUPS = {
    "api": {"sluice": "sluice api"},
    "workers": {
        "sluice": "sluice workers",
        "plain_celery": "celery workers",
        "celery_sluice_handler": "celery workers",
    },
    "redis": {peer: "redis-server" for peer in PEERS},
    "client": {peer: "client" for peer in PEERS},
}
PLAIN_DB = 2  # Sluice and the handler peer take 0 and 1 (`bench.celery_peer`)
PRECISIONS = ("fp32", "bf16", "int8", "auto")
RATIOS = (("sluice", "plain_celery"), ("sluice", "celery_sluice_handler"))
FULL = {
    "repeats": 3,
    "rates": "10,15,20,25,30,40,50,60",
    "step_s": 12.0,
    "steps_past_miss": 1,
    "quiet_wait": 5.0,
    "busy_retries": 2,
    "output": "slo_throughput.json",
}
QUICK = {
    "repeats": 1,
    "rates": "12,24",
    "step_s": 5.0,
    "steps_past_miss": 0,
    "quiet_wait": 0.0,
    "busy_retries": 0,
    "output": "slo_throughput_quick.json",
}
MIN_JOBS = 300  # the fewest samples `sluice.stats.percentiles` gives a p99 for


def precision_artifact(precision: str) -> str:
    """The artifact URI Sluice and the handler peer run for `--precision`: the only place that
    knows how a precision is spelled in a URI."""
    return f"{MINILM_URI}?precision={precision}"


# --- pure: a step's verdict, a repeat's SLO rate, the summary over repeats --------------------------


def meets_budget(step: dict[str, Any], budget_ms: float) -> bool:
    """A p99 at or under the budget, from enough samples, with no request failed."""
    p99 = step["p99_ms"]
    return p99 is not None and p99 <= budget_ms and step["failed"] == 0


def slo_rate(points: Sequence[tuple[float, bool]]) -> dict[str, Any]:
    """From (offered rate, met the budget) of one ramp: the highest rate below the first miss.

    `censored` says when the ramp did not bracket it: "above" (no step missed: the rate is a
    lower bound) or "below" (the lowest step missed: the rate is 0).
    """
    best = 0.0
    for rate, met in sorted(points):
        if not met:
            return {"rate": best, "censored": "below" if best == 0.0 else None}
        best = rate
    return {"rate": best, "censored": "above" if points else "below"}


def _ramps(steps: Sequence[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    ramps: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for step in steps:
        ramps.setdefault(step["peer"], {}).setdefault(step["repeat"], []).append(step)
    return ramps


def summarise(steps: Sequence[dict[str, Any]], budget_ms: float) -> dict[str, Any]:
    """Per peer the SLO rate of each repeat and its spread, the CPU per job at that rate, p99 per
    offered rate; the ratios of Sluice's SLO rate to each Celery peer's, repeat by repeat (None
    where the denominator is 0)."""
    ramps = _ramps(steps)
    peers: dict[str, Any] = {}
    chosen: dict[str, dict[int, dict[str, Any]]] = {}
    for peer, repeats in ramps.items():
        by_repeat = {
            r: slo_rate([(s["rate"], meets_budget(s, budget_ms)) for s in ramp]) for r, ramp in repeats.items()
        }
        chosen[peer] = by_repeat
        at_slo = [s for r, ramp in repeats.items() for s in ramp if s["rate"] == by_repeat[r]["rate"]]
        rates = sorted({s["rate"] for ramp in repeats.values() for s in ramp})
        peers[peer] = {
            "slo_rate": {**spread([v["rate"] for v in by_repeat.values()]), "by_repeat": by_repeat},
            "cpu_ms_per_job_at_slo_rate": {
                group: spread([s["cpu_ms_per_job"][group] for s in at_slo]) for group in (*GROUPS, "total")
            },
            "p99_ms_by_rate": {
                f"{rate:g}": spread([s["p99_ms"] for ramp in repeats.values() for s in ramp if s["rate"] == rate])
                for rate in rates
            },
            # What other load changes least: the CPU a job costs the peer's processes and its client.
            "total_cpu_ms_per_job_by_rate": {
                f"{rate:g}": spread(
                    [s["cpu_ms_per_job"]["total"] for ramp in repeats.values() for s in ramp if s["rate"] == rate]
                )
                for rate in rates
            },
        }
    ratios: dict[str, Any] = {}
    for top, bottom in RATIOS:
        if top in chosen and bottom in chosen:
            both = sorted(set(chosen[top]) & set(chosen[bottom]))
            values = [
                chosen[top][r]["rate"] / chosen[bottom][r]["rate"] if chosen[bottom][r]["rate"] > 0 else None
                for r in both
            ]
            ratios[f"{top}/{bottom}"] = {**spread(values), "by_repeat": values}
    # Other people's work on a shared machine takes cores from every peer: read the figures with it.
    other = spread([s["foreign_cores"] for s in steps])
    contended = sum(1 for s in steps if s.get("contended"))
    return {
        "budget_ms": budget_ms,
        "peers": peers,
        "ratios": ratios,
        "other_load_cores": other,
        "contended_steps": {"kept": contended, "of": len(steps)},
    }


# --- the three peers, up side by side ------------------------------------------------------------


@contextmanager
def three_peers(pg_url: str, artifact: str, max_wait_ms: float | None) -> Iterator[dict[str, Stack]]:
    """Each peer's view of one set of processes: the stack whose Celery broker its client uses and
    whose process groups are measured (Sluice's phases use the handler peer's, idle then)."""
    with both_systems(pg_url, artifact=artifact, max_wait_ms=max_wait_ms) as stack:
        url = f"{stack.celery_url.rsplit('/', 1)[0]}/{PLAIN_DB}"
        plain = celery_worker(stack.platform.home, url, app="bench.celery_transformers", env={"HF_HUB_OFFLINE": "1"})
        try:
            plain_stack = dataclasses.replace(stack, celery=plain, celery_url=url)
            wait_children(url, CELERY_CHILDREN, plain_stack.check_alive)
            yield {"sluice": stack, "plain_celery": plain_stack, "celery_sluice_handler": stack}
        finally:
            stop_processes([plain])


# --- the ramp -----------------------------------------------------------------------------------


def step_record(phase: dict[str, Any], *, peer: str, repeat: int, rate: float) -> dict[str, Any]:
    """What the summary and the JSON keep of one client phase (not its every latency)."""
    per_job = phase["cpu_ms_per_job"]
    cpu = {group: per_job[names[peer]] if peer in names else None for group, names in GROUPS.items()}
    cpu["total"] = sum(v for v in cpu.values() if v is not None)
    return {
        "peer": peer,
        "repeat": repeat,
        "rate": rate,
        "offered_rate": phase["offered_rate"],
        "requests": phase["requests"],
        "failed": phase["requests"] - phase["succeeded"],
        "not_succeeded": phase["not_succeeded"],
        "refused_429": phase["refused_429"],
        "p99_ms": phase["latency_ms"]["p99"],
        "latency_ms": phase["latency_ms"],
        "send_lag_ms": phase["send_lag_ms"],
        "mean_batch_size": phase["mean_batch_size"],
        "cpu_ms_per_job": cpu,
        "cpu_ms_per_job_by_process_group": per_job,
        "window_s": phase["window_s"],
        "foreign_cores": phase["foreign_cores"],
    }


def run_step(stack: Stack, spec: dict[str, Any], workdir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every attempt at one step, the kept one last: a step measured while other people's work
    took more than `--max-other-load` cores, or begun while the machine was that busy, is measured
    again, up to `--busy-retries` times (the last attempt is kept whatever its load, marked
    `contended`)."""
    attempts: list[dict[str, Any]] = []
    while True:
        busy = wait_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
        phase = run_phase(stack, spec, workdir)
        step = step_record(phase, peer=spec["peer"], repeat=spec["repeat"], rate=spec["rate"])
        # A step that began on a busy machine is measured again too: its own stack still starting
        # counts as none of the other load, yet delays its client's sends (seen as the first step
        # of a ramp, 1.0 busy core before it and the sends 168 ms late at the median).
        began_busy = busy is not None and busy > args.max_other_load
        step.update(
            busy_cores_before=busy,
            attempt=len(attempts) + 1,
            contended=step["foreign_cores"] > args.max_other_load or began_busy,
        )
        attempts.append(step)
        verdict = "within" if meets_budget(step, args.budget_ms) else "OVER"
        print(f"{progress_line(phase)}; {verdict} {args.budget_ms:g} ms", flush=True)
        if not step["contended"] or len(attempts) > args.busy_retries:
            return attempts
        print(f"    other load above {args.max_other_load:g} cores: measured again", flush=True)


def measure(stacks: dict[str, Stack], args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The kept steps, and the attempts measured again for other load."""
    workdir = stacks["sluice"].platform.home / "logs"
    steps: list[dict[str, Any]] = []
    discarded: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        misses = dict.fromkeys(args.peers, 0)
        for i, rate in enumerate(args.rates):
            jobs = max(MIN_JOBS, math.ceil(rate * args.step_s))
            for peer in args.peers if repeat % 2 == 0 else args.peers[::-1]:
                if misses[peer] > args.steps_past_miss:
                    continue
                print(f"[repeat {repeat + 1}] {peer}: open loop at {rate:g} jobs/s, {jobs} requests ...", flush=True)
                spec = {
                    "system": CLIENT[peer],
                    "mode": "open",
                    "n": jobs,
                    "rate": rate,
                    # The same texts and timetable for every peer at a step.
                    "seed": args.seed + 1000 * repeat + i,
                    "pool": args.client_pool,
                }
                *retried, step = run_step(stacks[peer], {**spec, "peer": peer, "repeat": repeat}, workdir, args)
                discarded += retried
                steps.append(step)
                if not meets_budget(step, args.budget_ms) or misses[peer]:
                    misses[peer] += 1
    return steps, discarded


# --- what is printed and drawn -------------------------------------------------------------------


def _range(s: dict[str, Any], digits: int = 1) -> str:
    if s["median"] is None:
        return "n/a"
    if s["n"] == 1:
        return fmt(float(s["median"]), digits)
    return f"{fmt(float(s['median']), digits)} [{fmt(float(s['min']), digits)}-{fmt(float(s['max']), digits)}]"


def print_summary(summary: dict[str, Any], info: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nHOST: {info['cpu']}, {info['cores']} cores, flags {' '.join(info['cpu_flags']) or 'none of note'}; "
        f"torch {info['torch']}; precision {args.precision} ({args.artifact}); other load "
        f"{_range(summary['other_load_cores'], 2)} cores over the steps; {summary['contended_steps']['kept']} "
        f"of {summary['contended_steps']['of']} steps kept above {args.max_other_load:g} cores of it"
    )
    rows = []
    for peer in PEERS:
        if peer not in summary["peers"]:
            continue
        s = summary["peers"][peer]
        censored = [f"r{r + 1} {v['censored']}" for r, v in s["slo_rate"]["by_repeat"].items() if v["censored"]]
        cpu = s["cpu_ms_per_job_at_slo_rate"]
        rows.append(
            [
                LABELS[peer],
                _range(s["slo_rate"]),
                ", ".join(censored) or "-",
                *(_range(cpu[g], 2) for g in (*GROUPS, "total")),
            ]
        )
    print(
        f"\nTHROUGHPUT WITHIN p99 <= {args.budget_ms:g} ms (highest offered rate before the first miss; "
        f"median [min-max] over {args.repeats} repeat(s)) and CPU ms PER JOB at that rate"
    )
    print(table(["peer", "SLO rate jobs/s", "not bracketed", "api", "workers", "redis", "client", "total"], rows))
    for name, ratio in summary["ratios"].items():
        per_repeat = ", ".join(fmt(r, 2) for r in ratio["by_repeat"])
        print(f"ratio {name}: {_range(ratio, 2)} (per repeat: {per_repeat})")
    by_rate = {peer: s["p99_ms_by_rate"] for peer, s in summary["peers"].items()}
    rates = sorted({float(r) for p99s in by_rate.values() for r in p99s}, key=float)
    rows = [
        [
            f"{rate:g}",
            *(_range(by_rate[p][f"{rate:g}"], 0) if f"{rate:g}" in by_rate.get(p, {}) else "-" for p in PEERS),
        ]
        for rate in rates
    ]
    print("\np99 ms BY OFFERED RATE (open loops, Poisson; from the scheduled send to the result seen by the client)")
    print(table(["jobs/s", *PEERS], rows))
    by_rate = {peer: s["total_cpu_ms_per_job_by_rate"] for peer, s in summary["peers"].items()}
    rows = [
        [
            f"{rate:g}",
            *(_range(by_rate[p][f"{rate:g}"], 2) if f"{rate:g}" in by_rate.get(p, {}) else "-" for p in PEERS),
        ]
        for rate in rates
    ]
    print(
        "\nCPU ms PER JOB BY OFFERED RATE, the peer's processes, Redis and the client (what other load changes least)"
    )
    print(table(["jobs/s", *PEERS], rows))


def plot(steps: Sequence[dict[str, Any]], budget_ms: float, title: str, path: Path) -> Path | None:
    """p99 (log) against the offered rate, every repeat's point and the median line per peer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for peer, repeats in _ramps(steps).items():
        points = [(s["rate"], s["p99_ms"]) for ramp in repeats.values() for s in ramp if s["p99_ms"] is not None]
        if not points:
            continue
        medians = [
            (rate, statistics.median(p for r, p in points if r == rate)) for rate in sorted({r for r, _ in points})
        ]
        drawn = ax.plot([r for r, _ in medians], [p for _, p in medians], marker="o", label=LABELS[peer])
        ax.scatter([r for r, _ in points], [p for _, p in points], s=12, alpha=0.4, color=drawn[0].get_color())
    ax.axhline(budget_ms, color="grey", linestyle="--", label=f"budget {budget_ms:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate, jobs/s (Poisson)")
    ax.set_ylabel("p99 latency, ms")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.slo_throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke check (~3 min): the defaults marked quick")
    parser.add_argument("--repeats", type=int, help="repeats of the ramp, interleaved (3; quick 1)")
    parser.add_argument("--rates", help="offered rates of the ramp, jobs/s (10,15,20,25,30,40,50,60; quick 12,24)")
    parser.add_argument(
        "--step-s", type=float, help="seconds of arrivals per step, at least 300 requests (12; quick 5)"
    )
    parser.add_argument("--budget-ms", type=float, default=300.0, help="the p99 budget (300)")
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="fp32", help="what Sluice and its handler run (fp32)"
    )
    parser.add_argument("--peers", default=",".join(PEERS), help=f"which peers, comma-separated ({','.join(PEERS)})")
    parser.add_argument(
        "--max-wait-ms", type=float, help="Sluice's batching window for its version (default: the seed's, 10 ms)"
    )
    parser.add_argument("--steps-past-miss", type=int, help="steps measured after a peer's first miss (1; quick 0)")
    parser.add_argument(
        "--max-other-load",
        type=float,
        default=0.5,
        help="a step during which other processes took more cores than this is measured again (0.5)",
    )
    parser.add_argument("--busy-retries", type=int, help="how many times a step is measured again (2; quick 0)")
    parser.add_argument("--client-pool", type=int, default=128, help="the client's connections or threads (128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet-wait", type=float, help="wait up to this many s for an idle machine (5; quick 0)")
    parser.add_argument(
        "--pg-url",
        default="postgresql://postgres@127.0.0.1:5432/test",
        help="a Postgres database on the server where a scratch database may be created",
    )
    parser.add_argument("--output", help="file under bench/results/ (slo_throughput.json; quick *_quick.json)")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.rates = sorted(float(r) for r in str(args.rates).split(","))
    args.peers = [peer for peer in PEERS if peer in {p.strip() for p in args.peers.split(",")}]
    if not args.peers:
        parser.error(f"--peers takes some of {', '.join(PEERS)}")
    args.artifact = precision_artifact(args.precision)
    from sluice.artifacts import parse_artifact
    from sluice.errors import ArtifactError

    try:
        parse_artifact(args.artifact)
    except ArtifactError as exc:
        parser.error(f"--precision {args.precision}: {exc}")
    if args.repeats < 1 or min(args.rates) <= 0 or args.steps_past_miss < 0 or args.busy_retries < 0:
        parser.error("--repeats must be >= 1, --rates > 0, --steps-past-miss and --busy-retries >= 0")

    command = command_line("bench.slo_throughput")
    info = machine_info()
    print(
        f"Throughput within p99 <= {args.budget_ms:g} ms: {info['cores']} cores ({info['cpu']}); "
        f"mix {SKEWED.describe()}; precision {args.precision}; seed {args.seed}",
        flush=True,
    )
    with sigterm_as_interrupt(), three_peers(args.pg_url, args.artifact, args.max_wait_ms) as stacks:
        steps, discarded = measure(stacks, args)
    summary = summarise(steps, args.budget_ms)
    print_summary(summary, info, args)
    title = f"{info['cpu']}, {info['cores']} cores; precision {args.precision}; {args.repeats} repeat(s)"
    figure = plot(steps, args.budget_ms, title, RESULTS_DIR / Path(args.output).with_suffix(".png").name)
    path = write_json(
        args.output,
        {
            "bench": "slo_throughput",
            "command": command,
            "machine": info,
            "params": {**vars(args), "mix": SKEWED.describe()},
            "percentile_method": PERCENTILE_METHOD,
            "summary": summary,
            "steps": steps,
            "discarded_for_other_load": discarded,
        },
    )
    print(f"reproduce: {command}\nresults: bench/results/{path.name}")
    print(f"figure: bench/results/{figure.name}" if figure else "figure: none (matplotlib is not installed)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; everything started by the bench was stopped", file=sys.stderr)
        sys.exit(130)
