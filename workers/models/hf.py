"""A team's Hugging Face models, served from a local directory through ``transformers``.

``hf-embedding`` takes any BERT-family encoder (``AutoModel``) and pools it as its
sentence-transformers files say: ``modules.json`` names the Pooling module (mean, CLS or max
tokens, or several of them concatenated in sentence-transformers' order) and whether a Normalize
module follows. A directory without ``modules.json`` is pooled by the mean over its tokens and
not normalised, which is what sentence-transformers itself does for a plain Hugging Face model.
``hf-classifier`` takes any ``AutoModelForSequenceClassification``; its labels are the config's
``id2label`` in index order and its scores the softmax of the logits.

Loading is offline and safe: weights come from ``model.safetensors`` only (the file whose sha256
the registry records; a pickle is never read), nothing is fetched, and a directory that asks for
its own code (``auto_map``) is refused. The sequence limit is ``max_seq_length`` of
``sentence_bert_config.json`` when present, else the tokenizer's ``model_max_length``, either capped
by the config's ``max_position_embeddings``; longer inputs are truncated. Models run in the
precision the version's artifact asks for (``workers/models/precision.py``; by default float32 on
the CPU and bf16 on a GPU); pooling and softmax stay in float32. In int8 every projection of the
encoder runs as dynamic int8 (:func:`workers.models.int8.quantize_linears`), unsmoothed: the
calibration's quality bound decides whether that is close enough for ``auto``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from sluice.errors import ArtifactError, InferenceError
from sluice.kinds import ModelKind
from workers.models.int8 import quantize_linears
from workers.models.packed import pack_linears, packs
from workers.models.precision import INT8, default_precision
from workers.models.protocol import ModelHandler
from workers.models.text_handlers import WARMUP_BATCHES, texts_of

WEIGHTS_FILE = "model.safetensors"
_SAFE = {"local_files_only": True, "trust_remote_code": False}
# Without any of these, transformers builds an empty-vocabulary tokenizer that maps every word to
# [UNK] instead of failing.
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                    "tokenizer.model")
_ST = "sentence_transformers.models."
# sentence-transformers concatenates the modes it is given in this order.
_POOLING_MODES = ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_tokens")
_UNSUPPORTED_POOLING = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                        "pooling_mode_lasttoken")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path.parent}: missing {path.name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path.parent}: unreadable {path.name}: {exc}") from exc


def _check_dir(model_dir: Path) -> dict[str, Any]:
    """The directory's config.json, once the directory is known safe to hand to transformers."""
    if not model_dir.is_dir():
        raise ArtifactError(f"Hugging Face model must be a directory, got {model_dir}")
    if not (model_dir / WEIGHTS_FILE).is_file():
        found = ", ".join(sorted(p.name for p in model_dir.glob("*.bin"))) or "none"
        raise ArtifactError(f"{model_dir}: no {WEIGHTS_FILE} (pickled weights found: {found}; "
                            "only safetensors are loaded)")
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ArtifactError(f"{model_dir}: no tokenizer files (one of {', '.join(_TOKENIZER_FILES)})")
    config = _read_json(model_dir / "config.json")
    if not isinstance(config, dict):
        raise ArtifactError(f"{model_dir}: config.json is not a JSON object")
    # auto_map names Python files shipped with the model; running them is what we refuse.
    tokenizer_config = model_dir / "tokenizer_config.json"
    for name, raw in (("config.json", config),
                      ("tokenizer_config.json", _read_json(tokenizer_config) if tokenizer_config.exists() else {})):
        if isinstance(raw, dict) and "auto_map" in raw:
            raise ArtifactError(f"{model_dir}: {name} has auto_map (the model's own code); remote code is refused")
    return config


def _dtype(precision: str) -> torch.dtype:
    from workers.models.calibration import torch_dtype

    return torch_dtype(precision)


def _max_length(model_dir: Path, config: Mapping[str, Any], tokenizer: Any) -> int:
    limit = tokenizer.model_max_length
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.exists():
        limit = _read_json(st_config).get("max_seq_length", limit)
    # Tokenizers without a limit report a huge sentinel, and positions past the table would crash.
    limits = [n for n in (limit, config.get("max_position_embeddings")) if isinstance(n, int) and n > 0]
    if not limits:
        raise ArtifactError(f"{model_dir}: neither its files nor config.json give a sequence limit")
    return min(limits)


def _load(model_dir: Path, config: Mapping[str, Any], auto: Any, device: str, precision: str,
          *, unused: tuple[str, ...] = ()) -> tuple[Any, Any, int]:
    """Tokenizer, model and sequence limit; ``unused`` prefixes weights the handler never reads."""
    # Its loading progress bar would land in the worker's JSON log as terminal escapes.
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **_SAFE)
        model, info = auto.from_pretrained(model_dir, use_safetensors=True, dtype=_dtype(precision),
                                           output_loading_info=True, **_SAFE)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as exc:
        raise ArtifactError(f"{model_dir}: transformers cannot load it: {exc}") from exc
    # transformers fills weights missing from the checkpoint with random ones (a classifier saved
    # without its head, say) and only logs it; serving those would answer noise.
    missing = sorted(k for k in info["missing_keys"] if not k.startswith(unused))
    if missing:
        raise ArtifactError(f"{model_dir}: {WEIGHTS_FILE} lacks weights the model needs: {', '.join(missing[:5])}"
                            + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    if tokenizer.pad_token is None:
        raise ArtifactError(f"{model_dir}: the tokenizer has no padding token, so batches cannot be padded")
    model = model.to(device).eval()
    if packs(torch.device(device), _dtype(precision)):
        # Only the projections' layout changes (`workers/models/packed.py`): 1.07-1.21x less CPU
        # per text in bf16 on an AMX host.
        pack_linears(model)
    if precision == INT8:
        # The encoder's projections only: a classifier's last layer decides labels on small margins.
        quantize_linears(model.base_model, skip=("pooler",))
    return tokenizer, model, _max_length(model_dir, config, tokenizer)


class _HfText(ModelHandler):
    """A tokenizer and a model over ``{"text": str}`` inputs; each batch pads to its longest."""

    length_buckets = True

    def __init__(self, *, tokenizer: Any, model: torch.nn.Module, device: str, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.device = torch.device(device)
        self.max_length = max_length

    def passes(self, inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return [list(range(len(inputs)))]

    def warmup(self) -> None:
        for batch in WARMUP_BATCHES:
            self.run([{"text": text} for text in batch])

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        texts = texts_of(inputs)
        if not texts:
            return []
        try:
            return self._outputs(self._tensors(texts))
        except (RuntimeError, ValueError) as exc:
            # Out-of-memory and shape errors surface as these; the worker bisects on InferenceError.
            raise InferenceError(f"{type(self).__name__} failed on a batch of {len(texts)}: {exc}") from exc

    @torch.inference_mode()
    def _forward(self, texts: Sequence[str]) -> tuple[Mapping[str, torch.Tensor], Any]:
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)
        return batch, self.model(**batch)

    def _tensors(self, texts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def _outputs(self, rows: torch.Tensor) -> list[dict[str, Any]]:
        raise NotImplementedError


class HfEmbeddingHandler(_HfText):
    """``{"text": str}`` -> ``{"embedding": [float, ...], "dim": int}``."""

    kind = ModelKind.hf_embedding

    def __init__(self, *, pooling: Sequence[str], normalize: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pooling = tuple(pooling)
        self.normalize = normalize

    @torch.inference_mode()
    def vectors(self, texts: Sequence[str]) -> torch.Tensor:
        """The (N, dim) float32 CPU sentence vectors of ``texts``, pooled in float32."""
        batch, out = self._forward(texts)
        hidden = out.last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = []
        for mode in self.pooling:
            if mode == "pooling_mode_cls_token":
                pooled.append(hidden[:, 0])
            elif mode == "pooling_mode_max_tokens":
                pooled.append(hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(dim=1))
            else:
                pooled.append((hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9))
        vectors = torch.cat(pooled, dim=-1)
        if self.normalize:
            vectors = F.normalize(vectors, p=2.0, dim=-1)
        return vectors.cpu()

    def _tensors(self, texts: Sequence[str]) -> torch.Tensor:
        return self.vectors(texts)

    def _outputs(self, rows: torch.Tensor) -> list[dict[str, Any]]:
        dim = int(rows.shape[-1])
        return [{"embedding": row, "dim": dim} for row in rows.tolist()]


class HfClassifierHandler(_HfText):
    """``{"text": str}`` -> ``{"label": str, "scores": {label: probability}}``."""

    kind = ModelKind.hf_classifier

    def __init__(self, *, labels: Sequence[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.labels = list(labels)

    @torch.inference_mode()
    def probabilities(self, texts: Sequence[str]) -> torch.Tensor:
        """The (N, labels) float32 CPU softmax of ``texts``' logits, taken in float32."""
        _, out = self._forward(texts)
        return torch.softmax(out.logits.float(), dim=-1).cpu()

    def _tensors(self, texts: Sequence[str]) -> torch.Tensor:
        return self.probabilities(texts)

    def _outputs(self, rows: torch.Tensor) -> list[dict[str, Any]]:
        return [
            {"label": self.labels[max(range(len(row)), key=row.__getitem__)],
             "scores": {label: round(p, 6) for label, p in zip(self.labels, row, strict=True)}}
            for row in rows.tolist()
        ]


def _st_modules(model_dir: Path) -> tuple[tuple[str, ...], bool]:
    """The pooling modes and whether to normalise, from the sentence-transformers files."""
    if not (model_dir / "modules.json").exists():
        return ("pooling_mode_mean_tokens",), False
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ArtifactError(f"{model_dir}: modules.json is not a list of modules")
    pooling_path: str | None = None
    for module in modules:
        kind, path = str(module.get("type", "")), str(module.get("path", ""))
        if kind == _ST + "Pooling":
            pooling_path = path
        elif kind == _ST + "Transformer" and path not in ("", "."):
            # Only the top-level model.safetensors is hashed; weights elsewhere would go unchecked.
            raise ArtifactError(f"{model_dir}: the Transformer module must be the directory itself, not {path!r}")
        elif kind not in (_ST + "Transformer", _ST + "Normalize"):
            # Skipping a module (a Dense projection, say) would serve vectors the model never made.
            raise ArtifactError(f"{model_dir}: modules.json lists {kind!r}, which hf-embedding does not run")
    if pooling_path is None:
        raise ArtifactError(f"{model_dir}: modules.json has no sentence_transformers.models.Pooling module")
    config = _read_json(model_dir / pooling_path / "config.json")
    if not isinstance(config, dict):
        raise ArtifactError(f"{model_dir}/{pooling_path}/config.json is not a JSON object")
    unsupported = [mode for mode in _UNSUPPORTED_POOLING if config.get(mode)]
    modes = tuple(mode for mode in _POOLING_MODES if config.get(mode))
    if unsupported or not modes:
        raise ArtifactError(f"{model_dir}/{pooling_path}/config.json: pooling {unsupported or 'none'} is not "
                            f"supported; use one or more of {', '.join(_POOLING_MODES)}")
    return modes, any(m.get("type") == _ST + "Normalize" for m in modules)


def load_hf_embedding(model_dir: Path, *, device: str, precision: str | None = None) -> HfEmbeddingHandler:
    """An hf-embedding handler over ``model_dir`` on ``device`` (``"cpu"`` or ``"cuda"``) in
    ``precision`` (by default that of the device)."""
    config = _check_dir(model_dir)
    pooling, normalize = _st_modules(model_dir)
    # The pooler head (the CLS vector's extra projection) is not part of a sentence embedding.
    tokenizer, model, max_length = _load(model_dir, config, AutoModel, device,
                                         precision or default_precision(torch.device(device).type), unused=("pooler.",))
    return HfEmbeddingHandler(tokenizer=tokenizer, model=model, device=device, max_length=max_length,
                              pooling=pooling, normalize=normalize)


def load_hf_classifier(model_dir: Path, *, device: str, precision: str | None = None) -> HfClassifierHandler:
    """An hf-classifier handler over ``model_dir`` on ``device`` (``"cpu"`` or ``"cuda"``) in
    ``precision`` (by default that of the device)."""
    tokenizer, model, max_length = _load(model_dir, _check_dir(model_dir), AutoModelForSequenceClassification, device,
                                         precision or default_precision(torch.device(device).type))
    config = model.config
    if config.problem_type in ("regression", "multi_label_classification") or config.num_labels < 2:
        raise ArtifactError(f"{model_dir}: problem_type {config.problem_type!r} with {config.num_labels} label(s) "
                            "is not single-label classification; softmax scores would be meaningless")
    labels = [str(config.id2label[i]) for i in range(config.num_labels)]
    if len(set(labels)) != len(labels):
        raise ArtifactError(f"{model_dir}: id2label repeats a label: {labels}")
    return HfClassifierHandler(tokenizer=tokenizer, model=model, device=device, max_length=max_length,
                               labels=labels)
