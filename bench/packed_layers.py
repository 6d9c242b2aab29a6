"""bf16 MiniLM on the CPU: the packed layers the worker runs against the plain bf16 layers.

With ``--hf``, the same for a Hugging Face model (``hf-embedding`` of the bundled MiniLM through
``transformers``), whose projections alone are packed (``pack_linears``), each batch padded whole.

Both encoders live in one process on 1 torch thread and encode the same arrival-order batches of
the skewed mix, alternating batch by batch (the order flipped every repeat), so a neighbour that
slows the host for a second slows both alike: on a shared VM whole-run timings of the same work
have spread by 2x, batch-by-batch pairs by a few per cent. The figure is CPU time per text
(``time.process_time``) per batch size, each repeat's ratio plain / packed, and the cosine of the
packed vectors to the plain ones. Packing needs a CPU whose oneDNN runs bf16 (AVX512-BF16 or AMX).
Run: ``python -m bench.packed_layers [--texts 160] [--repeats 5] [--sizes 1,4,8,32] [--hf]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.inprocess import configure_torch
from bench.machine import machine_info
from bench.output import command_line, table, write_json
from scheduler.planning.text_mix import SKEWED, skewed_texts


def measure(encoders: dict[str, Any], texts: Sequence[str], size: int, repeats: int) -> dict[str, list[float]]:
    """CPU ms per text of each encoder, per repeat, the batches of one size taken in turns."""
    batches = [texts[i:i + size] for i in range(0, len(texts), size)]
    for encoder in encoders.values():
        for batch in batches[:4]:
            encoder.encode(batch)
    runs: dict[str, list[float]] = {name: [] for name in encoders}
    for repeat in range(repeats):
        order = list(encoders.items())
        if repeat % 2:
            order.reverse()
        spent = dict.fromkeys(encoders, 0.0)
        for batch in batches:
            for name, encoder in order:
                start = time.process_time()
                encoder.encode(batch)
                spent[name] += time.process_time() - start
        for name in encoders:
            runs[name].append(1000 * spent[name] / len(texts))
    return runs


class HfEncoder:
    """transformers' AutoModel over the bundled MiniLM, [CLS] of each text, as ``encode``."""

    def __init__(self, model_dir: Any, *, packed: bool) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from workers.models.packed import pack_linears

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        if packed:
            pack_linears(self.model)

    def encode(self, texts: Sequence[str]) -> Any:
        import torch

        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            return self.model(**batch).last_hidden_state[:, 0].float()


def run(args: argparse.Namespace) -> dict[str, Any]:
    configure_torch(1)
    import torch

    from sluice.artifacts import MINILM_URI, resolve_artifact
    from workers.models.minilm import MiniLMEncoder
    from workers.models.packed import packs

    if not packs(torch.device("cpu"), torch.bfloat16):
        raise SystemExit("this CPU's oneDNN runs no bf16: nothing is packed here")
    model_dir = resolve_artifact(MINILM_URI)
    encoders: dict[str, Any]
    if args.hf:
        encoders = {"plain": HfEncoder(model_dir, packed=False), "packed": HfEncoder(model_dir, packed=True)}
    else:
        encoders = {"plain": MiniLMEncoder(model_dir=model_dir, dtype=torch.bfloat16, packed=False),
                    "packed": MiniLMEncoder(model_dir=model_dir, dtype=torch.bfloat16)}
    texts = skewed_texts(args.texts, seed=args.seed)
    cosines = torch.nn.functional.cosine_similarity(
        encoders["plain"].encode(texts), encoders["packed"].encode(texts), dim=1)
    results = []
    for size in args.sizes:
        runs = measure(encoders, texts, size, args.repeats)
        ratios = [p / q for p, q in zip(runs["plain"], runs["packed"], strict=True)]
        results.append({"batch_size": size, "plain_cpu_ms_per_text": runs["plain"],
                        "packed_cpu_ms_per_text": runs["packed"], "plain_over_packed": ratios})
    return {"results": results, "cosine_packed_to_plain": {"min": cosines.min().item(), "mean": cosines.mean().item()}}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.packed_layers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=160, help="texts of the skewed mix (default 160)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="repeats per batch size (default 5)")
    parser.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 8, 32],
                        help="arrival-order batch sizes (default 1,4,8,32)")
    parser.add_argument("--hf", action="store_true", help="transformers' model, projections packed")
    parser.add_argument("--output", default=None,
                        help="file name under bench/results/ (packed_layers.json; --hf packed_layers_hf.json)")
    args = parser.parse_args(argv)
    args.output = args.output or ("packed_layers_hf.json" if args.hf else "packed_layers.json")
    info = machine_info()
    which = "MiniLM (transformers)" if args.hf else "MiniLM"
    print(f"packed vs plain bf16 {which}, {args.texts} texts ({SKEWED.describe()}), 1 torch thread, "
          f"{info['cpu']}, flags {' '.join(info['cpu_flags'])}, torch {info['torch']}")
    result = run(args)
    rows = []
    for r in result["results"]:
        ratios = r["plain_over_packed"]
        rows.append([r["batch_size"], statistics.median(r["plain_cpu_ms_per_text"]),
                     statistics.median(r["packed_cpu_ms_per_text"]),
                     f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}"])
    print(table(["batch", "plain CPU ms/text", "packed CPU ms/text", "plain / packed", "per repeat"], rows))
    cos = result["cosine_packed_to_plain"]
    print(f"cosine of packed to plain vectors: min {cos['min']:.6f}, mean {cos['mean']:.6f}")
    command = command_line("bench.packed_layers")
    path = write_json(args.output, {"bench": "packed_layers", "command": command, "machine": info,
                                    "params": {**vars(args), "mix": SKEWED.describe()}, **result})
    print(f"reproduce: {command}\nresults: {path}")


if __name__ == "__main__":
    main()
