"""A team's own handler class (sluice.handler.Handler) behind the worker's ModelHandler protocol.

The worker already splits a failing batch to find the input that fails; this adapter makes every
way a handler can go wrong on a batch an InferenceError naming what went wrong (it raised, it
answered the wrong count, an output does not fit its ``Output``), so that bisection ends with the
guilty input failed for good and a message its submitter can act on. Messages name fields and
error types, never values: inputs and outputs are user data.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from sluice.errors import ArtifactError, InferenceError, ModelError
from sluice.handler import Handler, InputFile, Quality, import_handler, schemas_of
from sluice.kinds import ModelKind
from workers.models.protocol import ModelHandler

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# A label becomes a metrics-free aggregate key (label counts in /stats): keep it a short name.
_MAX_LABEL_CHARS = 64


def _problems(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in error['loc']) or '(root)'}: {error['type']}"
                     for error in exc.errors()[:3])


def _canonical(schema: Mapping[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True)


class UserHandler(ModelHandler):
    """Runs a Handler subclass: validates each input against ``Input`` and each output against
    ``Output``, and turns its quality proxy into the worker's per-job proxies."""

    kind = ModelKind.handler
    # A handler pads or not as it likes; grouping by its declared cost is what it asked for.
    length_buckets = True

    def __init__(self, *, spec: str, handler: Handler[Any, Any]) -> None:
        self.spec = spec
        self.handler = handler
        self._input = type(handler).Input
        self._output = type(handler).Output
        self.takes_files = issubclass(self._input, InputFile)

    @staticmethod
    def passes(inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return [list(range(len(inputs)))]

    def warmup(self) -> None:
        try:
            self.handler.warmup()
        except Exception as exc:
            raise ArtifactError(f"handler {self.spec}: warmup() raised {type(exc).__name__}: {exc}") from exc

    def _parse(self, index: int, item: Mapping[str, Any]) -> BaseModel:
        try:
            return self._input.model_validate(item)
        except ValidationError as exc:
            raise InferenceError(f"input {index} does not fit {self._input.__name__}: {_problems(exc)}") from None

    def cost_of(self, item: Mapping[str, Any]) -> int | None:
        """The handler's cost of one input; None when it cannot say (the API's hint stands)."""
        try:
            cost = self.handler.cost(self._input.model_validate(item))
        except Exception:  # a faulty cost must not lose the job: run() reports the input
            return None
        return cost if isinstance(cost, int) and not isinstance(cost, bool) and cost >= 0 else None

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if not inputs:
            return []
        batch = [self._parse(i, item) for i, item in enumerate(inputs)]
        try:
            outputs = self.handler.predict(batch)
        except InferenceError:
            raise
        except Exception as exc:
            raise InferenceError(f"handler {self.spec} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(outputs, list | tuple) or len(outputs) != len(inputs):
            count = len(outputs) if isinstance(outputs, list | tuple) else type(outputs).__name__
            raise InferenceError(f"handler {self.spec} answered {count} outputs for {len(inputs)} inputs")
        return [self._dump(i, output) for i, output in enumerate(outputs)]

    def _dump(self, index: int, output: Any) -> dict[str, Any]:
        # An instance is checked again too: model_construct() and later assignments skip validation.
        data = output.model_dump(warnings=False) if isinstance(output, BaseModel) else output
        try:
            fitted = self._output.model_validate(data)
        except ValidationError as exc:
            raise InferenceError(
                f"handler {self.spec}: output {index} does not fit {self._output.__name__}: {_problems(exc)}"
            ) from None
        return fitted.model_dump(mode="json")

    def calibration_inputs(self) -> list[BaseModel]:
        """The handler's own calibration inputs (precision per host); ArtifactError if it has none."""
        try:
            return list(self.handler.calibration_inputs())
        except Exception as exc:
            raise ArtifactError(f"handler {self.spec}: calibration_inputs() raised {type(exc).__name__}: {exc}"
                                ) from exc

    def calibration_outputs(self, inputs: Sequence[BaseModel]) -> torch.Tensor:
        """Each input's output as the numbers the calibration compares (``calibration_vector``)."""
        import torch

        try:
            outputs = self.handler.predict(list(inputs))
            return torch.tensor([self.handler.calibration_vector(output) for output in outputs], dtype=torch.float32)
        except Exception as exc:
            raise ArtifactError(f"handler {self.spec}: its calibration outputs failed: {type(exc).__name__}: {exc}"
                                ) from exc

    def proxies(self, output: Mapping[str, Any]) -> dict[str, Any]:
        """The handler's quality proxy of one stored output, as the worker's per-job proxies."""
        try:
            quality = self.handler.quality(self._output.model_validate(output))
        except Exception as exc:  # a proxy never fails the job it describes
            log.warning("handler %s: quality() raised %s", self.spec, type(exc).__name__)
            return {}
        if not isinstance(quality, Quality):
            return {}
        found: dict[str, Any] = {}
        if quality.confidence is not None and 0.0 <= quality.confidence <= 1.0:
            found["top_p"] = round(float(quality.confidence), 6)
        if quality.label is not None:
            found["label"] = str(quality.label)[:_MAX_LABEL_CHARS]
        return found


def handler_class(spec: str) -> type[Handler[Any, Any]]:
    """The handler class ``spec`` names; ArtifactError when it cannot be imported or is no handler."""
    try:
        return import_handler(spec)
    except ModelError as exc:
        raise ArtifactError(str(exc)) from None


def load_user_handler(spec: str, artifact: Path | None, *, device: str,
                      input_schema: Mapping[str, Any] | None,
                      output_schema: Mapping[str, Any] | None, precision: str = "fp32") -> UserHandler:
    """Import, build and load the handler ``spec`` names on the verified ``artifact``, in
    ``precision`` (set on the handler before ``load``; fp32 unless it declares others).

    The version's recorded schemas, when it has them, must be the class's own: the API validated
    the queued inputs against them. Any failure here refuses the version (ArtifactError).
    """
    cls = handler_class(spec)
    declared = schemas_of(cls)
    for name, recorded in (("input", input_schema), ("output", output_schema)):
        if recorded is not None and _canonical(recorded) != _canonical(declared[name]):
            raise ArtifactError(f"handler {spec}: the version records an {name} schema that differs from "
                                f"{cls.__name__}.{name.capitalize()}'s; register a new version for the new schema")
    try:
        handler = cls()
        handler.precision = precision
        handler.load(artifact, device)
    except Exception as exc:
        raise ArtifactError(f"handler {spec}: load() raised {type(exc).__name__}: {exc}") from exc
    return UserHandler(spec=spec, handler=handler)
