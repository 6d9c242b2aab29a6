"""A tiny scorer behind the handler API: ``sigmoid(scale * mean(values) + bias)``.

Its weights are a safetensors file in the artifact directory, so the artifact is hashed, published
and verified like any model's. ``behave`` lets a test make one input misbehave in each way a
handler can: raise, answer the wrong count, answer an output its schema refuses, or hang.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sluice.handler import Handler, Quality

WEIGHTS = "weights.safetensors"


class Reading(BaseModel):
    model_config = ConfigDict(extra="forbid")
    values: list[float] = Field(min_length=1, max_length=64)
    behave: Literal["well", "raise", "miscount", "misshape", "hang"] = "well"


class Score(BaseModel):
    model_config = ConfigDict(extra="forbid")
    score: float = Field(ge=0, le=1)
    label: Literal["low", "high"]


class TinyScorer(Handler[Reading, Score]):
    Input = Reading
    Output = Score

    def load(self, artifact: Path | None, device: str) -> None:
        from safetensors.torch import load_file

        assert artifact is not None
        weights = load_file(str(artifact / WEIGHTS), device=device)
        self.scale = float(weights["scale"])
        self.bias = float(weights["bias"])
        self.batches: list[int] = []

    def cost(self, item: Reading) -> int:
        return len(item.values)

    def predict(self, batch: list[Reading]) -> list[Score]:
        self.batches.append(len(batch))
        outputs = []
        for reading in batch:
            if reading.behave == "raise":
                raise ValueError("the scorer cannot read this reading")
            if reading.behave == "hang":
                time.sleep(600)
            score = 1 / (1 + math.exp(-(self.scale * sum(reading.values) / len(reading.values) + self.bias)))
            if reading.behave == "misshape":
                outputs.append(Score.model_construct(score=score, label="medium"))  # type: ignore[arg-type]
            else:
                outputs.append(Score(score=score, label="high" if score >= 0.5 else "low"))
        if any(reading.behave == "miscount" for reading in batch):
            outputs.append(outputs[-1])
        return outputs

    def quality(self, output: Score) -> Quality:
        return Quality(confidence=abs(output.score - 0.5) * 2, label=output.label)


def build_scorer(path: Path, *, scale: float = 1.0, bias: float = 0.0) -> Path:
    """The scorer's artifact directory, with its weights and a note, as a team would publish it."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({"scale": torch.tensor(scale), "bias": torch.tensor(bias)}, str(path / WEIGHTS))
    (path / "README.md").write_text("A tiny scorer for Sluice's handler tests.\n")
    return path
