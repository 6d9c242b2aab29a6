"""The handler API: how a team serves its own model with Sluice.

A handler is a class that declares its input and output schemas (pydantic models) and answers a
batch of validated inputs with one output each::

    class Sentiment(Handler[Review, Verdict]):
        Input = Review
        Output = Verdict

        def load(self, artifact: Path | None, device: str) -> None:
            self.model = torch.load(artifact / "weights.pt", weights_only=True).to(device)

        def cost(self, item: Review) -> int:
            return len(item.text)          # what drives this model's time: batches group by it

        def predict(self, batch: list[Review]) -> list[Verdict]:
            ...

A version names it as ``"handler": "package.module:Class"`` (admin only; the module must be
importable in the worker's environment). The worker builds it with no arguments, calls
``load(artifact directory, device)`` with the verified artifact (None when the version has none),
``warmup()`` once, then ``predict`` for every batch. Everything Sluice does around a batch works
for any handler: inputs are validated against ``Input`` before they are queued (the version
records its JSON Schema), batches group by ``cost``, a failing batch is split to find the input
that fails, and an output that does not fit ``Output``, a wrong count, or a batch running past the
version's timeout fails its jobs with a clear error.

``predict`` raises :class:`~sluice.errors.InferenceError` when an input itself is bad (the job
fails for good); any other exception is the handler's fault and the job is tried again elsewhere.

A job may name its input by reference (``input_uri``). By default the worker reads the object,
checks its size and sha256, parses it as JSON and hands ``predict`` that, validated against
``Input``, like any input. A handler for objects too large or not JSON (audio, archives, a
200 MiB log) sets ``Input`` to :class:`InputFile` (or a subclass): the worker then never reads
the object itself but verifies it and hands ``predict`` its path, size and sha256 to stream from.
Such a version takes only jobs by reference: an inline input would let a caller name any path.

This module is the kernel's contract and stays free of torch: the API reads schemas through it.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from sluice.errors import ModelError

InputT = TypeVar("InputT", bound=BaseModel)
OutputT = TypeVar("OutputT", bound=BaseModel)

# "package.module:Class": dotted module path, a colon, a class name (nested classes allowed).
_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


class InputFile(BaseModel):
    """The input of a handler that reads referenced objects itself: a verified object's real path,
    its size and its sha256, filled in by the worker (never by the caller)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Quality:
    """What one output says about its version's health, for the rollout guardrails and `/stats`:
    ``confidence`` in [0, 1] (low values count as low-confidence answers) and ``label``, a class
    name the model declares (never user text: it is aggregated and shown to operators)."""

    confidence: float | None = None
    label: str | None = None


class Handler(Generic[InputT, OutputT]):
    """Subclass this; set ``Input`` and ``Output``; implement ``load`` and ``predict``."""

    Input: ClassVar[type[BaseModel]]
    Output: ClassVar[type[BaseModel]]
    # Precision per host (docs/ARCHITECTURE.md): the precisions besides fp32 this handler can run
    # ("bf16", "fp16", "int8"); a version's `?precision=` is refused for a handler naming none. The
    # worker sets `precision` before `load`; with `auto` it loads one handler per candidate and
    # compares `calibration_vector` of their outputs on `calibration_inputs()` with fp32's, as
    # embeddings (worst cosine) or, with `precision_outputs = "classifier"`, as probabilities.
    precisions: ClassVar[tuple[str, ...]] = ()
    precision_outputs: ClassVar[str] = "embedding"
    precision: str = "fp32"

    def load(self, artifact: Path | None, device: str) -> None:
        """Load the model from the verified artifact (a file or a directory) onto ``device``
        (``"cpu"`` or ``"cuda"``)."""
        raise NotImplementedError

    def warmup(self) -> None:
        """Run a few batches before taking traffic, so the first job does not pay for it."""

    def cost(self, item: InputT) -> int:
        """What one input costs to run (tokens, pixels, ...): the worker batches inputs of similar
        cost together, so a batch pads to little. Every input costs the same by default."""
        return 1

    def predict(self, batch: list[InputT]) -> list[OutputT]:
        """One output per input, in order."""
        raise NotImplementedError

    def quality(self, output: OutputT) -> Quality | None:
        """An optional quality proxy of one output (see :class:`Quality`)."""
        return None

    def calibration_inputs(self) -> list[InputT]:
        """Inputs like the version's own, on which the precisions are timed and compared; needed
        when ``precisions`` is set."""
        raise NotImplementedError

    def calibration_vector(self, output: OutputT) -> list[float]:
        """The numbers of one output the calibration compares with fp32's: an embedding's vector,
        or a classifier's probability per label, the labels always in the same order."""
        raise NotImplementedError


def check_spec(spec: str) -> str:
    """``spec`` if it reads ``package.module:Class``; a ModelError naming the form otherwise."""
    if not _SPEC.match(spec):
        raise ModelError(f"handler {spec!r} must read 'package.module:Class'")
    return spec


def import_handler(spec: str) -> type[Handler[Any, Any]]:
    """Import the handler class ``spec`` names and check it is one."""
    module_name, _, qualname = check_spec(spec).partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"handler {spec!r}: cannot import {module_name!r}: {exc}") from exc
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ModelError(f"handler {spec!r}: {module_name!r} has no {qualname!r}") from None
    if not (isinstance(target, type) and issubclass(target, Handler)):
        raise ModelError(f"handler {spec!r} is not a subclass of sluice.handler.Handler")
    for name in ("Input", "Output"):
        schema = getattr(target, name, None)
        if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
            raise ModelError(f"handler {spec!r} must set {name} to a pydantic model class")
    return target


def schemas_of(handler: type[Handler[Any, Any]]) -> dict[str, dict[str, Any]]:
    """The JSON Schemas a version of this handler records: ``{"input": ..., "output": ...}``."""
    return {"input": handler.Input.model_json_schema(), "output": handler.Output.model_json_schema()}
