"""The re-tune's proof: a version tuned on short texts is fed a mix that turns long; one run of the
re-tune's planning on what the real worker recorded proposes another setting, and that setting
sustains more on the long mix within the p99 budget than the one tuned on short texts, measured on
a real worker.

    python -m bench.retune [--repeats 3] [--phase-s 8] [--p99-budget-ms 300]

Steps, all on one real `Worker` (the synthetic handler, which sleeps its declared cost: the worker's
batching is what is measured, not a busy machine's CPU) on a private Valkey:

1. Serve the short mix at the starting setting; the worker's tally records the mix and the passes
   in Redis (sluice/wire/mix.py). Plan on them as the nightly job does (`scheduler.retune`: the
   recorded mix, the cost fitted to the recorded passes, `scheduler.planning.retune.plan`): the
   setting tuned on short texts.
2. Serve the long mix at that setting; plan again on what was recorded there: the proposal.
3. For each repeat (its own arrivals' seed), sweep both settings on the long mix on the real worker
   (the frontier's capacity probe and Poisson ladder) and take each one's best sustained throughput
   whose p99 meets the budget; report the ratio proposed / tuned-on-short, per repeat, its median
   and its spread.

The re-tune job itself also reads and writes the registry; here the planning runs on exactly the
inputs it reads from Redis, without Postgres.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench.machine import KERNEL_FLAGS
from bench.output import command_line, table, write_json
from launch.frontier_run import (
    DEFAULT_SYNTHETIC,
    Options,
    RealReplica,
    RecordingHandler,
    TextPool,
    _loop_factory,
    load,
    model_tokens,
    redis_for,
    resolve_target,
)
from scheduler.planning.frontier import ConfigRun, fit_cost, sweep
from scheduler.planning.retune import Grid, Proposal, plan
from scheduler.planning.text_mix import LengthMix, skewed_texts
from sluice.kinds import token_estimate
from sluice.mix import Mix
from sluice.wire import mix as wire_mix

SHORT = LengthMix(long_fraction=0.0, short_words=(6, 20))
LONG = LengthMix(long_fraction=0.7, short_words=(6, 20), long_words=(100, 200))
# What the version is served at before any tuning.
START = (8, 10.0)


def pool(handler: Any, mix: LengthMix, n: int, seed: int) -> TextPool:
    texts = skewed_texts(n, seed=seed, mix=mix)
    return TextPool(texts=tuple(texts), costs=tuple(token_estimate(t) for t in texts),
                    tokens=tuple(model_tokens(handler, texts)))


def host() -> dict[str, Any]:
    """The CPU's model name and the kernel flags it has (what `lscpu` shows), cores, load."""
    import os
    from pathlib import Path

    model, flags = "", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {"cpu": model, "cpu_flags": [f for f in KERNEL_FLAGS if f in flags], "cores": os.cpu_count(),
            "loadavg_at_start": os.getloadavg()}


class RecordedReplica(RealReplica):
    """The frontier's real replica, keeping what each version's worker recorded (its mix and passes,
    sluice/wire/mix.py) before the version's keys are deleted."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hours: dict[tuple[int, str], Mix] = {}
        self.passes: list[wire_mix.Pass] = []

    async def _forget(self, version: str, ids: Sequence[str]) -> None:
        for key, counted in (await wire_mix.read_hours(self.redis, self.model, version)).items():
            self.hours[key] = self.hours.get(key, Mix()) + counted
        self.passes += await wire_mix.read_passes(self.redis, self.model, version)
        await super()._forget(version, ids)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.options = Options(model=args.model, version=None, batch_sizes=(), waits_ms=(),
                               fractions=tuple(args.fractions), phase_s=args.phase_s,
                               p99_budget_ms=args.p99_budget_ms, threads=1, device="cpu", seed=args.seed,
                               texts=args.texts, min_ratio=0.95, redis_url=args.redis_url)
        self.inner = load(resolve_target(args.model, None), self.options)
        self.grid = Grid(batch_sizes=tuple(args.batch_sizes), waits_ms=tuple(args.waits_ms),
                         fractions=tuple(args.fractions), phase_s=args.phase_s)

    def replica(self, runner: asyncio.Runner, url: str, texts: TextPool) -> RecordedReplica:
        handler = RecordingHandler(self.inner, dict(zip(texts.texts, texts.tokens, strict=True)))
        return RecordedReplica(runner=runner, redis_url=url, handler=handler, pool=texts, options=self.options)

    def record_and_plan(self, runner: asyncio.Runner, url: str, texts: TextPool, setting: tuple[int, float],
                        rate: float, seed: int) -> Proposal:
        """Serve `texts` at `setting` and `rate` for two phases, then plan on what the worker recorded."""
        replica = self.replica(runner, url, texts)
        try:
            for step in range(2):
                replica.rung(setting[0], setting[1], rate, seed + step)
        finally:
            replica.close()
        mix = wire_mix.recent_mix(replica.hours, now_hour=wire_mix.hour_of(time.time()))
        passes = replica.passes
        fit = fit_cost([(p.size, p.longest, p.seconds) for p in passes])
        proposal = plan(mix=mix, cost=fit.cost, p99_budget_ms=self.args.p99_budget_ms, max_batch_size=setting[0],
                        max_wait_ms=setting[1], now=time.time(), grid=self.grid,
                        on={"mix": mix.to_mapping(), "samples": mix.total, "passes": len(passes),
                            "fit": fit.describe()})
        if proposal is None:
            raise SystemExit(f"no setting of the grid meets {self.args.p99_budget_ms:g} ms on this mix")
        return proposal

    def sustained(self, runner: asyncio.Runner, url: str, texts: TextPool, setting: tuple[int, float],
                  seed: int) -> tuple[float | None, ConfigRun]:
        replica = self.replica(runner, url, texts)
        replica.options = replace(self.options, seed=seed)
        try:
            series = sweep("real", batch_sizes=(setting[0],), waits_ms=(setting[1],), fractions=self.grid.fractions,
                           seed=seed, probe=replica.probe, rung=replica.rung)
        finally:
            replica.close()
        config = series.configs[0]
        best = config.at_budget(self.args.p99_budget_ms)
        return (best.throughput_rps if best else None), config

    def run(self) -> dict[str, Any]:
        args = self.args
        short = pool(self.inner, SHORT, args.texts, args.seed)
        long_ = pool(self.inner, LONG, args.texts, args.seed + 1)
        with redis_for(args.redis_url) as url, asyncio.Runner(loop_factory=_loop_factory()) as runner:
            on_short = self.record_and_plan(runner, url, short, START, args.record_rps, args.seed)
            tuned = (on_short.max_batch_size, on_short.max_wait_ms)
            print(f"tuned on short texts: batch {tuned[0]}, wait {tuned[1]:g} ms "
                  f"(simulated {on_short.throughput_rps:.1f}/s at p99 {on_short.p99_ms:.0f} ms)")
            on_long = self.record_and_plan(runner, url, long_, tuned, args.record_rps / 4, args.seed + 10)
            proposed = (on_long.max_batch_size, on_long.max_wait_ms)
            print(f"proposed on the long mix: batch {proposed[0]}, wait {proposed[1]:g} ms "
                  f"(simulated gain {on_long.gain if on_long.gain is None else f'{on_long.gain:+.1%}'})")
            rows, repeats = [], []
            for repeat in range(args.repeats):
                seed = args.seed + 100 * (repeat + 1)
                # Alternate which setting runs first, so a machine that slows during a repeat does not
                # always cost the same one.
                order = (tuned, proposed) if repeat % 2 == 0 else (proposed, tuned)
                measured = {s: self.sustained(runner, url, long_, s, seed) for s in order}
                old, new = measured[tuned][0], measured[proposed][0]
                ratio = new / old if old and new else None
                repeats.append({"seed": seed, "tuned_on_short_rps": old, "proposed_rps": new, "ratio": ratio,
                                "configs": {f"{s[0]}/{s[1]:g}": measured[s][1].to_dict(args.p99_budget_ms)
                                            for s in order}})
                rows.append([repeat + 1, old, new, ratio])
                print(table(["repeat", "tuned on short /s", "proposed /s", "ratio"], rows[-1:]))
        ratios = [r["ratio"] for r in repeats if r["ratio"] is not None]
        summary = {"median_ratio": statistics.median(ratios) if ratios else None,
                   "min_ratio": min(ratios) if ratios else None, "max_ratio": max(ratios) if ratios else None,
                   "repeats_with_a_ratio": len(ratios)}
        print(table(["repeat", "tuned on short /s", "proposed /s", "ratio"], rows))
        print(f"proposed / tuned-on-short within p99 {args.p99_budget_ms:g} ms on the long mix: median "
              f"{summary['median_ratio']}, spread {summary['min_ratio']} - {summary['max_ratio']}")
        return {"bench": "retune", "command": command_line("bench.retune"), "host": host(),
                "model": args.model, "p99_budget_ms": args.p99_budget_ms,
                "mixes": {"short": SHORT.describe(), "long": LONG.describe()}, "start": START,
                "tuned_on_short": on_short.to_dict(), "proposed_on_long": on_long.to_dict(),
                "proposal_changed": tuned != proposed, "repeats": repeats, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_SYNTHETIC,
                        help="a synthetic cost URI (default), or minilm / intent")
    parser.add_argument("--p99-budget-ms", type=float, default=300.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--record-rps", type=float, default=120.0,
                        help="the rate the short mix is served at while it is recorded (the long at a quarter)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--waits-ms", type=float, nargs="+", default=[0.0, 5.0, 20.0, 50.0])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.7, 0.85, 0.95])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default=None, help="default: a private Valkey")
    args = parser.parse_args()
    started = time.monotonic()
    result = Bench(args).run()
    result["seconds"] = round(time.monotonic() - started, 1)
    print(f"wrote {write_json('retune.json', result)}")


if __name__ == "__main__":
    main()
