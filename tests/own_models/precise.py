"""A handler that opts in to precision per host: a fixed random projection of a text's letter
counts, normalised, in the dtype the worker sets (``precision``) before ``load``."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from sluice.handler import Handler

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Text(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=1000)


class Vector(BaseModel):
    vector: list[float]


class LetterVectors(Handler[Text, Vector]):
    Input = Text
    Output = Vector
    precisions: ClassVar[tuple[str, ...]] = ("bf16",)

    def load(self, artifact: Path | None, device: str) -> None:
        self.loaded_in = self.precision
        weights = torch.randn(26, 256, generator=torch.Generator().manual_seed(3))
        self.projection = torch.nn.Linear(26, 256).to(_DTYPES[self.precision])
        with torch.no_grad():
            self.projection.weight.copy_(weights.T)

    def predict(self, batch: list[Text]) -> list[Vector]:
        counts = torch.tensor([[item.text.lower().count(chr(97 + i)) for i in range(26)] for item in batch],
                              dtype=torch.float32)
        with torch.inference_mode():
            out = self.projection(counts.to(self.projection.weight.dtype)).float()
        return [Vector(vector=row) for row in torch.nn.functional.normalize(out, dim=-1).tolist()]

    def calibration_inputs(self) -> list[Text]:
        return [Text(text=f"where is my parcel number {i}, it said it would arrive by now") for i in range(64)]

    def calibration_vector(self, output: Vector) -> list[float]:
        return output.vector
