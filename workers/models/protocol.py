"""The protocol between the worker and a model handler: every member the worker reads.

A handler class subclasses :class:`ModelHandler` explicitly, so it inherits the defaults of the
members it has no use for, and a wrapper (``launch.frontier_run.PassThroughHandler``) can pass the
whole surface through without probing for members.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from sluice.kinds import ModelKind
from workers.models.precision import PrecisionChoice


@runtime_checkable
class ModelHandler(Protocol):
    """What the worker needs from a model, whatever its kind."""

    kind: ModelKind
    # True when the model pads a batch to its longest input and runs it as one pass: the worker
    # then groups inputs by length first. False when the handler plans its own forward passes
    # (``passes``): the worker then takes everything ready at once and runs it pass by pass.
    length_buckets: bool

    def passes(self, inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        """The indices of ``inputs`` grouped into the forward passes that run them cheapest, each
        stored as soon as it is done; asked only when ``length_buckets`` is False."""
        ...

    def warmup(self) -> None:
        """Run a few dummy batches of different lengths before taking traffic."""
        ...

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """One output per input, same order.

        Raise InferenceError when an input itself is bad: the worker bisects the batch and fails
        that job for good. Any other exception is taken for the worker's fault (a bug, a lost
        device): the job is delivered again, and dead-lettered with the message if it never runs.
        """
        ...

    # The worker reads these of every handler too; a handler with no use for one keeps the default.
    # The precision the handler chose at load (fp32, int8, bf16) and why, exported as a metric and
    # in the heartbeat; None where the kind has no choice to make.
    precision: PrecisionChoice | None = None
    # True when the handler reads a job's referenced object itself (a handler class whose `Input`
    # is sluice.handler.InputFile): the worker hands it the verified object's path, not its bytes.
    takes_files: bool = False

    def cost_of(self, item: Mapping[str, Any]) -> int | None:
        """The handler's own cost of one input, in the units the batcher packs by (tokens for the
        text kinds); None leaves the API's estimate in place."""
        return None

    def count_tokens(self, inputs: Sequence[Mapping[str, Any]]) -> tuple[int, int] | None:
        """(padded, real) tokens the model computes running ``inputs`` as one call to ``run``, each
        pass padded to its longest input; None where the kind has no tokens or the handler does not
        count them (the worker then pads the batcher's costs)."""
        return None

    def proxies(self, output: Mapping[str, Any]) -> dict[str, Any] | None:
        """The handler's own quality proxies of one output (a handler class's `quality`); None
        leaves the kind's own proxies in place."""
        return None
