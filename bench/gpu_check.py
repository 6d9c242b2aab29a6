"""The GPU check: one command, at most 8 minutes, on a machine with a CUDA GPU.

``python -m bench.gpu_check --out DIR [--model-dir DIR] [--budget-s 420]`` writes ``gpu_check.json``
and ``gpu_check.png`` under ``--out``:

1. **The calibration's CUDA path**: ``select_precision("auto")`` on the MiniLM encoder, as a
   worker with ``--device cuda`` runs it: the candidates the GPU offers (fp32, bf16 where supported,
   fp16), each one's wall-time speed over fp32 and its worst cosine, and the choice.
2. **The worker's runtime against plain in-process torch**, per precision (fp32, bf16, fp16) and
   batch size (1 to 256), with the texts in arrival order and sorted by length:
   * ``sluice``: ``MiniLMEncoder.encode``, what a worker runs per batch: tokenization, the
     planner's passes, the forward passes, pooling in fp32, and the copy to the CPU;
   * ``plain``: what a team writes: the tokenizer padding the whole batch to its longest text,
     one forward pass of the same weights, mean pooling, the copy to the CPU.
   Texts per second over the same texts (the skewed mix), the median of ``--repeats`` runs.
3. With ``--compile``: ``torch.compile`` (inductor, ``dynamic=True``) of the encoder against eager,
   per precision (fp32, bf16) at batches of 128 and 256 in both orders through the worker's
   runtime, with the compile time (the first pass over every batch shape) and the cosine between
   compiled and eager vectors.
4. The host: GPU name, capability, torch and CUDA versions, the CPU.

``--model-dir`` takes a MiniLM directory (the installed package's by default). The GPU machine has
no package registry and a small upload, so ``python -m bench.gpu_check --pack DIR`` writes a copy
whose weights are stored in fp16 (45 MB; fp32 runs upcast them, so every precision is compared
against the same fp32 numbers). Configurations left when ``--budget-s`` is spent are skipped and
listed. The platform end to end (API, Redis, Postgres) does not run there: see bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.batch_plans import sorted_batches
from scheduler.planning.text_mix import skewed_texts

PRECISIONS = ("fp32", "bf16", "fp16")
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ORDERS = ("arrival", "sorted")
RUNTIMES = ("sluice", "plain")
_MODEL_FILES = ("config.json", "sentence_bert_config.json", "modules.json", "tokenizer.json", "vocab.txt",
                "tokenizer_config.json", "special_tokens_map.json")


def pack(model_dir: Path, target: Path) -> None:
    """A copy of ``model_dir`` with its weights in fp16, small enough to carry to a GPU machine."""
    import torch
    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    for name in _MODEL_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, target / name)
    if (model_dir / "1_Pooling").is_dir():
        shutil.copytree(model_dir / "1_Pooling", target / "1_Pooling", dirs_exist_ok=True)
    weights = load_file(str(model_dir / "model.safetensors"))
    save_file({k: v.to(torch.float16) if v.is_floating_point() else v for k, v in weights.items()},
              str(target / "model.safetensors"))


def _batches(texts: list[str], lengths: list[int], size: int, order: str) -> list[list[int]]:
    if order == "sorted":
        return sorted_batches(lengths, size)
    return [list(range(i, min(i + size, len(texts)))) for i in range(0, len(texts), size)]


class PlainEncoder:
    """The same weights as a team would run them: pad the batch to its longest, one pass, mean-pool."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder  # a MiniLMEncoder: its tokenizer and model, none of its planning

    def encode(self, texts: list[str]) -> Any:
        import torch

        encoder = self.encoder
        encs = encoder._tokenizer.encode_batch(texts)
        ids, mask, types = encoder._padded([e.ids for e in encs], [e.type_ids for e in encs])
        with torch.inference_mode():
            return encoder.forward_pooled(ids, mask, types).cpu()


def _time(run: Any, texts: list[str], batches: list[list[int]], repeats: int) -> dict[str, Any]:
    chunks = [[texts[i] for i in batch] for batch in batches]
    for chunk in chunks[:2]:
        run(chunk)  # first-call allocations and kernel selection
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        for chunk in chunks:
            run(chunk)  # each ends in a copy to the CPU, which waits for the GPU
        rates.append(len(texts) / (time.perf_counter() - started))
    return {"texts_per_s": statistics.median(rates), "all_texts_per_s": rates}


def calibration(model_dir: Path, device: str) -> dict[str, Any]:
    from workers.models.calibration import embedding_quality, select_precision, torch_dtype
    from workers.models.minilm import MiniLMEncoder
    from workers.models.precision import PrecisionPolicy

    def build(precision: str) -> MiniLMEncoder:
        return MiniLMEncoder(model_dir=model_dir, device=device, dtype=torch_dtype(precision))

    started = time.perf_counter()
    selected = select_precision("auto", device=device, policy=PrecisionPolicy(), build=build,
                                outputs=MiniLMEncoder.encode, compare=embedding_quality)
    choice = selected.choice
    return {"chosen": choice.precision, "reason": choice.reason, "speedups": dict(choice.measured),
            "seconds": time.perf_counter() - started}


def sweep(model_dir: Path, *, device: str, texts_n: int, repeats: int, sizes: tuple[int, ...],
          deadline: float) -> tuple[list[dict[str, Any]], list[str]]:
    import torch

    from workers.models.calibration import embedding_quality, torch_dtype
    from workers.models.minilm import MiniLMEncoder

    texts = skewed_texts(texts_n, seed=5)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    reference = None
    for precision in PRECISIONS:
        if device == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
            skipped.append("bf16: not supported by this GPU")
            continue
        if device == "cpu" and precision == "fp16":
            continue
        encoder = MiniLMEncoder(model_dir=model_dir, device=device, dtype=torch_dtype(precision))
        lengths = encoder.token_lengths(texts)
        vectors = encoder.encode(texts)
        if reference is None:
            reference = vectors
        cosine = embedding_quality(reference, vectors).worst_cosine
        runs = {"sluice": encoder.encode, "plain": PlainEncoder(encoder).encode}
        for size in sizes:
            for order in ORDERS:
                for runtime, run in runs.items():
                    name = f"{precision}/{runtime}/{order}/{size}"
                    if time.monotonic() > deadline:
                        skipped.append(f"{name}: past the time budget")
                        continue
                    timed = _time(run, texts, _batches(texts, lengths, size, order), repeats)
                    rows.append({"precision": precision, "runtime": runtime, "order": order, "batch_size": size,
                                 "worst_cosine_to_fp32": cosine, **timed})
                    print(f"{name}: {timed['texts_per_s']:.0f} texts/s", flush=True)
        del encoder, runs
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, skipped


def compiled(model_dir: Path, *, device: str, texts_n: int, repeats: int, deadline: float) -> list[dict[str, Any]]:
    import torch

    from workers.models.calibration import embedding_quality, torch_dtype
    from workers.models.minilm import MiniLMEncoder

    texts = skewed_texts(texts_n, seed=6)
    rows: list[dict[str, Any]] = []
    for precision in ("fp32", "bf16"):
        if time.monotonic() > deadline:
            break
        encoder = MiniLMEncoder(model_dir=model_dir, device=device, dtype=torch_dtype(precision))
        lengths = encoder.token_lengths(texts)
        plans = {(size, order): _batches(texts, lengths, size, order) for size in (128, 256) for order in ORDERS}
        eager = {key: _time(encoder.encode, texts, plan, repeats)["texts_per_s"] for key, plan in plans.items()}
        reference = encoder.encode(texts)
        encoder.model = torch.compile(encoder.model, dynamic=True)
        started = time.perf_counter()
        for plan in plans.values():  # every pass shape the timed runs will meet
            for batch in plan:
                encoder.encode([texts[i] for i in batch])
        compile_s = time.perf_counter() - started
        cosine = embedding_quality(reference, encoder.encode(texts)).worst_cosine
        for (size, order), plan in plans.items():
            rate = _time(encoder.encode, texts, plan, repeats)["texts_per_s"]
            rows.append({"precision": precision, "batch_size": size, "order": order,
                         "eager_texts_per_s": eager[size, order], "compiled_texts_per_s": rate,
                         "speedup": rate / eager[size, order], "compile_s": compile_s,
                         "worst_cosine_to_eager": cosine})
            print(f"compile {precision}/{order}/{size}: {rate / eager[size, order]:.2f}x eager "
                  f"(compile {compile_s:.1f} s)", flush=True)
        del encoder
        torch._dynamo.reset()
    return rows


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ORDERS), figsize=(13, 5), sharey=True)
    for ax, order in zip(axes, ORDERS, strict=True):
        for precision in PRECISIONS:
            for runtime, style in (("sluice", "-"), ("plain", ":")):
                points = sorted((r["batch_size"], r["texts_per_s"]) for r in rows
                                if r["order"] == order and r["precision"] == precision and r["runtime"] == runtime)
                if points:
                    ax.plot(*zip(*points, strict=True), style, marker="o", label=f"{precision} {runtime}")
        ax.set(xscale="log", yscale="log", xlabel="batch size", title=f"texts in {order} order")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("texts per second")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def host(device: str) -> dict[str, Any]:
    import torch

    if device != "cuda":
        return {"gpu": None, "torch": torch.__version__, "python": sys.version.split()[0],
                "cpu": platform.processor() or platform.machine()}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "memory_gib": props.total_memory / 2**30,
            "bf16": torch.cuda.is_bf16_supported(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "cpu": platform.processor() or platform.machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--model-dir", type=Path, default=None, help="a MiniLM directory (default: the installed one)")
    parser.add_argument("--texts", type=int, default=512, help="texts of the skewed mix per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip what is left after this many seconds")
    parser.add_argument("--pack", type=Path, default=None, help="write an fp16-weights copy of the model here and stop")
    parser.add_argument("--sizes", type=lambda v: tuple(int(x) for x in v.split(",")), default=BATCH_SIZES,
                        help="batch sizes to sweep (default 1 to 256)")
    parser.add_argument("--compile", action="store_true", help="also measure torch.compile against eager")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the script itself, on few texts and sizes")
    args = parser.parse_args()
    if args.model_dir is None:
        from sluice.artifacts import MINILM_URI, resolve_artifact

        args.model_dir = resolve_artifact(MINILM_URI)
    if args.pack is not None:
        pack(args.model_dir, args.pack)
        print(f"packed {args.model_dir} into {args.pack}")
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.gpu_check needs a CUDA GPU")
    smoke = args.device == "cpu"
    deadline = time.monotonic() + args.budget_s
    result: dict[str, Any] = {"bench": "gpu_check", "command": " ".join(sys.argv), "host": host(args.device)}
    result["calibration"] = calibration(args.model_dir, args.device)
    print(f"calibration: {result['calibration']}", flush=True)
    result["runs"], result["skipped"] = sweep(
        args.model_dir, device=args.device, texts_n=16 if smoke else args.texts, repeats=1 if smoke else args.repeats,
        sizes=(1, 8) if smoke else args.sizes, deadline=deadline)
    if args.compile:
        result["compile"] = compiled(args.model_dir, device=args.device, texts_n=16 if smoke else args.texts,
                                     repeats=1 if smoke else args.repeats, deadline=deadline)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    draw(result["runs"], args.out / "gpu_check.png")
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.png'}")


if __name__ == "__main__":
    main()
