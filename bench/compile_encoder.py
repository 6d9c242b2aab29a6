"""Compiled MiniLM on the CPU: torch.compile (inductor) and oneDNN fusion against eager, fp32 and bf16.

Configurations, each a ``MiniLMEncoder`` whose ``model`` is swapped for the compiled one, all in
one process on 1 torch thread (``--threads``):

* ``eager``: the plain module the worker runs;
* ``inductor``: ``torch.compile(model, dynamic=True)``, inductor's C++ code, one graph meant to
  serve every width;
* ``jit-freeze``: ``torch.jit.trace`` then ``torch.jit.freeze`` (TorchScript's frozen
  optimisations, no fuser);
* ``onednn``: the same traced and frozen graph run with ``torch.jit.enable_onednn_fusion(True)``
  (oneDNN Graph fuses the matmuls with their neighbours);
* ``packed`` (bf16 only): the layers the worker runs in bf16 on the CPU
  (``workers/models/packed.py``: weights reordered once, the GELU fused), where ``eager`` is the
  same module unpacked (``MiniLMEncoder(packed=False)``);

each in fp32 and, where the CPU has avx512_bf16 or amx_bf16, in bf16 (the module cast, as
``MiniLMEncoder(dtype=torch.bfloat16, packed=False)`` does). The texts are the skewed mix, handed over in
arrival-order batches of 32 and 8 and one at a time: ``encode`` splits each batch into the passes
``MiniLMEncoder.passes`` plans, so the shapes are the ones a worker runs.

The first run of a configuration over both plans is its compile run (every distinct pass shape
of the run is met there); its wall time beyond a steady run's is reported as the compile time,
the figure that adds to a worker's cold start. Inductor's is measured twice: with an empty cache
directory (a fresh host or container) and again after ``torch._dynamo.reset()`` with that cache
filled (a restart on the same host; a new process would add a few seconds of imports).
Then ``--repeats`` interleaved runs: CPU time of the process per text (``time.process_time``: a
shared host takes wall time away but hardly changes the CPU a run needs), and per repeat each
configuration's ratio to eager fp32 and to eager of its own dtype timed in the same repeat.
Agreement is the cosine of each configuration's vectors to eager fp32's on the same texts.
Run: ``python -m bench.compile_encoder [--texts 160] [--repeats 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from bench.batch_plans import arrival_batches
from bench.inprocess import configure_torch
from bench.machine import CpuWindow, machine_info, wait_quiet
from bench.output import command_line, table, write_json
from bench.quantized import encode_plan
from scheduler.planning.text_mix import SKEWED, skewed_texts

KINDS = ("eager", "inductor", "jit-freeze", "onednn", "packed")
BATCH_SIZES = (32, 8, 1)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        line = next((line for line in f if line.startswith("flags")), "")
    return [flag for flag in BF16_FLAGS if flag in line.split()]


def distinct_shapes(encoder: Any, lengths: Sequence[int], plans: dict[int, list[list[int]]]) -> dict[str, Any]:
    """The (rows, width) of every forward pass the planner makes for each plan, counted."""
    shapes: dict[int, set[tuple[int, int]]] = {}
    for size, batches in plans.items():
        shapes[size] = {(len(chunk), max(lengths[batch[i]] for i in chunk))
                        for batch in batches for chunk in encoder.passes([lengths[j] for j in batch])}
    union = set().union(*shapes.values())
    return {"by_batch_size": {size: len(s) for size, s in shapes.items()}, "all": len(union),
            "widths": len({w for _, w in union}), "row_counts": sorted({r for r, _ in union})}


class OneDNNFused:
    """A frozen TorchScript module run with oneDNN Graph fusion on. The switch is process-wide,
    so it is on only around this module's calls and the plain ``jit-freeze`` one runs unfused."""

    def __init__(self, *, module: Any) -> None:
        self.module = module

    def __call__(self, *inputs: Any) -> Any:
        import torch

        torch.jit.enable_onednn_fusion(True)
        try:
            return self.module(*inputs)
        finally:
            torch.jit.enable_onednn_fusion(False)


def traced(encoder: Any) -> Any:
    import torch

    # Two rows of different lengths, so no size is traced as the constant 1.
    ids, mask, types = encoder._padded([[101, 2023, 2003, 102], [101, 2023, 102]], [[0] * 4, [0] * 3])
    with torch.no_grad():
        module = torch.jit.trace(  # type: ignore[no-untyped-call]
            encoder.model, (ids, mask, types), check_trace=False)
        return torch.jit.freeze(module.eval())


def build(kind: str, encoder: Any, eager: Any) -> Any:
    import torch

    if kind == "eager":
        return eager
    if kind == "packed":
        from workers.models.minilm import MiniLMEncoder

        return MiniLMEncoder(model_dir=encoder.model_dir, dtype=encoder.dtype).model
    if kind == "inductor":
        return torch.compile(eager, dynamic=True)
    module = traced(encoder)
    return OneDNNFused(module=module) if kind == "onednn" else module


def run_plans(encoder: Any, texts: Sequence[str], plans: dict[int, list[list[int]]]) -> dict[int, dict[str, float]]:
    out = {}
    for size, batches in plans.items():
        window = CpuWindow()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        encode_plan(encoder, texts, batches)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        window.stop()
        out[size] = {"cpu_ms_per_text": 1000 * cpu / len(texts), "wall_s": wall,
                     "foreign_cores": window.foreign_cores(cpu)}
    return out


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def first_run(encoder: Any, texts: Sequence[str], plans: dict[int, list[list[int]]]) -> dict[str, float]:
    graphs0 = graphs_compiled()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    run_plans(encoder, texts, plans)
    return {"wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0,
            "graphs": graphs_compiled() - graphs0}


def spread(values: Sequence[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "n/a"


def run(args: argparse.Namespace) -> dict[str, Any]:
    cache_dir = tempfile.mkdtemp(prefix="sluice_inductor_")
    # Read when inductor first loads: a cold cache, as on a fresh host.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    configure_torch(args.threads)
    import torch

    from sluice.artifacts import MINILM_URI, resolve_artifact
    from workers.models.minilm import MiniLMEncoder

    model_dir = resolve_artifact(MINILM_URI)
    dtypes = {"fp32": torch.float32}
    if bf16_flags() and not args.fp32_only:
        dtypes["bf16"] = torch.bfloat16
    configs = [(kind, name) for name in dtypes for kind in KINDS
               if kind in args.kinds and (kind != "packed" or name == "bf16")]
    texts = skewed_texts(args.texts, seed=args.seed)
    encoders: dict[tuple[str, str], Any] = {}
    eager: dict[str, Any] = {}
    for name, dtype in dtypes.items():
        eager[name] = MiniLMEncoder(model_dir=model_dir, dtype=dtype, packed=False).model
    for kind, name in configs:
        encoder = MiniLMEncoder(model_dir=model_dir, dtype=dtypes[name], packed=False)
        encoder.model = eager[name]
        encoders[kind, name] = encoder
    reference = encoders["eager", "fp32"]
    lengths = reference.token_lengths(texts)
    plans = {size: arrival_batches(len(texts), size) for size in BATCH_SIZES}
    shapes = distinct_shapes(reference, lengths, plans)

    compile_runs: dict[tuple[str, str], dict[str, Any]] = {}
    for kind, name in configs:
        encoder = encoders[kind, name]
        wall0 = time.perf_counter()
        encoder.model = build(kind, encoder, eager[name])
        build_s = time.perf_counter() - wall0
        compile_runs[kind, name] = {"build_s": build_s, **first_run(encoder, texts, plans)}
    if ("inductor", "fp32") in encoders or ("inductor", "bf16") in encoders:
        # A reset drops every compiled graph at once, so the warm-cache runs come after all cold ones.
        torch._dynamo.reset()
        for name in dtypes:
            if ("inductor", name) in encoders:
                encoder = encoders["inductor", name]
                encoder.model = build("inductor", encoder, eager[name])
                compile_runs["inductor", name]["warm_cache"] = first_run(encoder, texts, plans)

    repeats: dict[tuple[str, str], list[dict[int, dict[str, float]]]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for config in configs:
            if args.quiet_wait > 0:
                wait_quiet(args.quiet_wait)
            repeats[config].append(run_plans(encoders[config], texts, plans))

    results: list[dict[str, Any]] = []
    ref_vectors = encode_plan(reference, texts, plans[32])
    for kind, name in configs:
        runs = repeats[kind, name]
        cosines = torch.nn.functional.cosine_similarity(
            ref_vectors, encode_plan(encoders[kind, name], texts, plans[32]), dim=1)
        for size in BATCH_SIZES:
            cpu = [r[size]["cpu_ms_per_text"] for r in runs]
            base = [r[size]["cpu_ms_per_text"] for r in repeats["eager", "fp32"]]
            same = [r[size]["cpu_ms_per_text"] for r in repeats["eager", name]] if ("eager", name) in repeats else []
            results.append({
                "kind": kind, "dtype": name, "batch_size": size, "cpu_ms_per_text": statistics.median(cpu),
                "all_cpu_ms_per_text": cpu,
                "vs_eager_fp32": [b / c for b, c in zip(base, cpu, strict=True)],
                "vs_eager_same_dtype": [b / c for b, c in zip(same, cpu, strict=True)],
                "wall_s": statistics.median(r[size]["wall_s"] for r in runs),
                "foreign_cores": [r[size]["foreign_cores"] for r in runs],
            })
        steady_wall = min(sum(r[s]["wall_s"] for s in BATCH_SIZES) for r in runs)
        run_info = compile_runs[kind, name]
        run_info["steady_wall_s"] = steady_wall
        run_info["compile_s"] = run_info["build_s"] + run_info["wall_s"] - steady_wall
        if "warm_cache" in run_info:
            run_info["warm_cache"]["compile_s"] = run_info["warm_cache"]["wall_s"] - steady_wall
        run_info["cosine_to_eager_fp32"] = {"min": cosines.min().item(), "mean": cosines.mean().item()}
    return {"results": results, "compile": {f"{k}-{n}": v for (k, n), v in compile_runs.items()},
            "shapes": shapes, "bf16_flags": bf16_flags(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "inductor_cache_dir": cache_dir}


def print_results(result: dict[str, Any]) -> None:
    rows = []
    for r in result["results"]:
        rows.append([r["batch_size"], f"{r['kind']} {r['dtype']}", r["cpu_ms_per_text"],
                     spread(r["all_cpu_ms_per_text"]), f"{statistics.median(r['vs_eager_fp32']):.2f}x",
                     spread(r["vs_eager_fp32"]),
                     f"{statistics.median(r['vs_eager_same_dtype']):.2f}x" if r["vs_eager_same_dtype"] else "n/a",
                     f"{max(r['foreign_cores']):.2f}"])
    print(table(["batch", "config", "CPU ms/text", "range", "x eager fp32", "per repeat", "x eager same dtype",
                 "other load (cores, max)"], rows))
    rows = []
    for config, c in result["compile"].items():
        warm = c.get("warm_cache")
        rows.append([config, c["compile_s"], c["cpu_s"], c["graphs"] if config.startswith("inductor") else "n/a",
                     warm["compile_s"] if warm else "n/a", f"{c['cosine_to_eager_fp32']['min']:.4f}"])
    print(table(["config", "compile s (wall)", "first run CPU s (this process)", "graphs compiled",
                 "compile s, warm cache", "cos min vs eager fp32"], rows))
    shapes = result["shapes"]
    print(f"distinct pass shapes (rows, width) the planner makes: {shapes['all']} "
          f"({', '.join(f'batches of {s}: {n}' for s, n in shapes['by_batch_size'].items())}), "
          f"{shapes['widths']} widths, row counts {shapes['row_counts']}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compile_encoder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=160, help="texts of the skewed mix (default 160)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the process (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per configuration (default 3)")
    parser.add_argument("--kinds", type=lambda v: v.split(","), default=list(KINDS),
                        help=f"comma-separated subset of {','.join(KINDS)} (eager is always run)")
    parser.add_argument("--fp32-only", action="store_true", help="skip bf16 even where the CPU has it")
    parser.add_argument("--quiet-wait", type=float, default=2.0,
                        help="before each run, wait up to this many s for the machine to be idle (0: off)")
    parser.add_argument("--quick", action="store_true",
                        help="about a minute: 32 texts, fp32 only, no plain jit-freeze, no quiet wait")
    parser.add_argument("--output", default=None, help="file name under bench/results/ (default compile_encoder.json)")
    args = parser.parse_args(argv)
    if args.quick:
        args.texts, args.fp32_only, args.quiet_wait = 32, True, 0.0
        args.kinds = [k for k in args.kinds if k != "jit-freeze"]
    if "eager" not in args.kinds:
        args.kinds = ["eager", *args.kinds]
    output = args.output or ("compile_encoder_quick.json" if args.quick else "compile_encoder.json")

    info = machine_info()
    print(f"compiled vs eager MiniLM, {args.texts} texts ({SKEWED.describe()}), seed {args.seed}, arrival batches "
          f"of {' and '.join(map(str, BATCH_SIZES))} run as the encoder's passes, {args.threads} torch thread(s), "
          f"{os.cpu_count()} cores, {info['cpu']}, torch {info['torch']}")
    result = run(args)
    print(f"bf16 CPU flags: {', '.join(result['bf16_flags']) or 'none (bf16 not run)'}; "
          f"torch kernels {result['cpu_capability']}")
    print_results(result)
    command = command_line("bench.compile_encoder")
    path = write_json(output, {"bench": "compile_encoder", "command": command, "machine": info,
                               "params": {**vars(args), "mix": SKEWED.describe()}, **result})
    print(f"reproduce: {command}\nresults: {path}   (CPU ms per text: median of {args.repeats} repeats; "
          f"ratios paired per repeat; compile s: the first run's wall time beyond a steady run's)")


if __name__ == "__main__":
    main()
