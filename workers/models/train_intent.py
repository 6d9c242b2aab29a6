"""Train the intent head over frozen MiniLM embeddings and write ``intent_head.safetensors``.

Run as ``python -m workers.models.train_intent``. The split is deterministic (every 5th
example of each label is held out) and training is full-batch with a fixed seed, so a rerun
on the same machine reproduces the same file.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sluice.artifacts import DIR_WEIGHTS_FILE, MINILM_URI, artifact_sha256, file_sha256, resolve_artifact
from workers.models.head import IntentHead, save_head, write_degraded_head
from workers.models.minilm import MiniLMEncoder

__all__ = [
    "DATA_PATH",
    "HEAD_PATH",
    "Example",
    "accuracy",
    "load_examples",
    "main",
    "split_examples",
    "train_head",
    "write_degraded_head",
]

PACKAGE_DIR = Path(__file__).resolve().parent
DATA_PATH = PACKAGE_DIR / "data" / "intents.jsonl"
HEAD_PATH = PACKAGE_DIR / "intent_head.safetensors"
HOLD_OUT_EVERY = 5


@dataclass(frozen=True, slots=True)
class Example:
    text: str
    label: str


def load_examples(path: Path = DATA_PATH) -> list[Example]:
    examples: list[Example] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("text"), str) or not isinstance(row.get("label"), str):
            raise ValueError(f"{path}:{lineno}: need string 'text' and 'label'")
        examples.append(Example(row["text"], row["label"]))
    return examples


def split_examples(examples: Sequence[Example]) -> tuple[list[Example], list[Example]]:
    """(train, held_out): the 5th, 10th, ... example of each label, in file order, is held out."""
    seen: dict[str, int] = {}
    train: list[Example] = []
    held_out: list[Example] = []
    for ex in examples:
        seen[ex.label] = seen.get(ex.label, 0) + 1
        (held_out if seen[ex.label] % HOLD_OUT_EVERY == 0 else train).append(ex)
    return train, held_out


def train_head(
    x: torch.Tensor,
    y: torch.Tensor,
    n_labels: int,
    *,
    hidden: int = 0,
    seed: int = 0,
    epochs: int = 500,
    lr: float = 0.02,
    weight_decay: float = 1e-4,
) -> IntentHead:
    """Full-batch Adam on frozen embeddings; a few hundred rows need no mini-batching."""
    torch.manual_seed(seed)
    head = IntentHead(x.shape[1], n_labels, hidden)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    head.train()
    for _ in range(epochs):
        opt.zero_grad()
        loss = F.cross_entropy(head(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return head.eval()


@torch.inference_mode()
def accuracy(head: IntentHead, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((head(x).argmax(dim=-1) == y).float().mean())


def _targets(examples: Sequence[Example], labels: Sequence[str]) -> torch.Tensor:
    index = {label: i for i, label in enumerate(labels)}
    return torch.tensor([index[ex.label] for ex in examples], dtype=torch.long)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DATA_PATH)
    parser.add_argument("--out", type=Path, default=HEAD_PATH)
    parser.add_argument("--hidden", type=int, default=0, help="hidden layer width; 0 = linear")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1, help="1 keeps float sums reproducible")
    parser.add_argument("--degraded-out", type=Path, help="also write a degraded copy here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    base_dir = resolve_artifact(MINILM_URI)
    encoder = MiniLMEncoder(model_dir=base_dir)
    examples = load_examples(args.data)
    labels = sorted({ex.label for ex in examples})
    train, held_out = split_examples(examples)

    # clone(): encode returns inference-mode tensors, which autograd refuses to save.
    x_train = encoder.encode([ex.text for ex in train]).clone()
    x_held = encoder.encode([ex.text for ex in held_out]).clone()
    y_train, y_held = _targets(train, labels), _targets(held_out, labels)

    head = train_head(x_train, y_train, len(labels), hidden=args.hidden, seed=args.seed, epochs=args.epochs)
    train_acc, held_acc = accuracy(head, x_train, y_train), accuracy(head, x_held, y_held)
    save_head(
        head,
        args.out,
        labels=labels,
        base_sha256=file_sha256(base_dir / DIR_WEIGHTS_FILE),
        extra={"held_out_accuracy": f"{held_acc:.4f}", "seed": str(args.seed)},
    )
    print(f"labels={len(labels)} train={len(train)} held_out={len(held_out)}")  # noqa: T201
    print(f"train accuracy={train_acc:.4f} held-out accuracy={held_acc:.4f}")  # noqa: T201
    print(f"wrote {args.out} sha256={artifact_sha256(args.out)}")  # noqa: T201
    if args.degraded_out:
        write_degraded_head(args.out, args.degraded_out, seed=args.seed)
        print(f"wrote {args.degraded_out} sha256={artifact_sha256(args.degraded_out)}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
