"""all-MiniLM-L6-v2 in plain torch: a 6-layer BERT encoder, mean pooling, L2 normalisation.

Only ``torch``, ``tokenizers`` and ``safetensors`` are used, so the worker never imports
``transformers``; the weights are read from ``model.safetensors`` (never a pickle).
Every projection is a plain ``nn.Linear`` (:mod:`workers.models.bert`), so
:func:`workers.models.int8.quantize_int8` can swap them for int8
kernels after loading (``quantize="int8"``) without a second weights file: the smoothing it
needs is calibrated at load on built-in texts (:data:`CALIBRATION_TEXTS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from sluice.errors import ArtifactError, ModelError
from workers.models.bert import WEIGHTS_FILE, BertConfig, BertEncoder, load_bert_weights, read_json
from workers.models.int8 import CALIBRATION_TEXTS, activation_maxima, quantize_int8
from workers.models.packed import pack_layers, packs

DEFAULT_MAX_SEQ_LENGTH = 256
# How the encoder splits a batch into forward passes (see MiniLMEncoder.passes). On one CPU
# thread of one host a pass cost about 25 tokens' worth beyond its padded tokens in fp32 (13.5 ms
# for one text of 18 tokens, 98 ms for 16 of them): the figure until the worker measures its own
# (`workers/models/pass_cost.py`). Past a few thousand padded tokens a pass's activations leave
# the cache and every token costs more.
DEFAULT_PASS_OVERHEAD_TOKENS = 24
DEFAULT_MAX_BATCH_TOKENS = 2048
# On a GPU a pass costs its kernel launches whatever its size (2.3 ms on an H200 for one short
# text, as much as a thousand or two padded tokens of a large pass), and memory allows passes of
# tens of thousands of tokens: short texts share one pass, and only a long text in a batch of
# short ones earns a pass of its own (`python -m bench.gpu_check`, bench/README.md).
GPU_PASS_OVERHEAD_TOKENS = 1024
GPU_MAX_BATCH_TOKENS = 65536


def resolve_device(device: str) -> torch.device:
    """``"auto"`` picks CUDA when present; an explicit ``"cuda"`` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} requested but CUDA is not available")
    return dev


def plan_passes(lengths: Sequence[int], *, max_batch_tokens: int, overhead_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into the forward passes that cost least.

    A pass costs ``overhead_tokens`` plus its padded tokens (texts x its longest text) and holds
    at most ``max_batch_tokens`` of them (a longer text runs alone). The best passes take
    contiguous runs of the texts sorted by length, so a dynamic programme over that order finds
    them: O(n^2) for a batch of n, a few hundred steps for 32. Where no pass can reach the cap (the
    whole batch padded fits under it, as on a GPU), only the boundaries between distinct lengths
    are tried: a cut between two equal lengths moved to the end of their run costs no more (the
    pass before gains a text of that length, the pass after loses one at least as wide), so the
    programme runs over distinct lengths, a few thousand steps for a batch of 256.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ranked = [lengths[i] for i in order]
    count = len(order)
    if count and count * ranked[-1] <= max_batch_tokens:
        cuts = [0, *(i for i in range(1, count) if ranked[i] != ranked[i - 1]), count]
    else:
        cuts = list(range(count + 1))
    # best[j]: least cost of the texts before cuts[j]; start[j]: the cut its last pass starts at.
    best = [0] * len(cuts)
    start = [0] * len(cuts)
    for j in range(1, len(cuts)):
        end = cuts[j]
        width = ranked[end - 1]
        best[j] = -1
        for k in range(j - 1, -1, -1):
            size = end - cuts[k]
            if size > 1 and size * width > max_batch_tokens:
                break
            cost = best[k] + overhead_tokens + size * width
            if best[j] < 0 or cost < best[j]:
                best[j], start[j] = cost, k
    passes: list[list[int]] = []
    j = len(cuts) - 1
    while j:
        passes.append(order[cuts[start[j]]:cuts[j]])
        j = start[j]
    passes.reverse()
    return passes


class MiniLMEncoder:
    """Sentence encoder with the same outputs as sentence-transformers' all-MiniLM-L6-v2.

    ``encode`` pads each batch only to its own longest text, so callers that batch by length
    pay for no padding beyond that; it returns float32 vectors on the CPU. ``quantize="int8"``
    runs the projections as dynamic int8 (CPU and float32 only; see :func:`quantize_int8`),
    smoothed with activation maxima measured at load on :data:`CALIBRATION_TEXTS`. In bf16 on the
    CPU its layers run packed (:mod:`workers.models.packed`) unless ``packed=False``.

    A batch of any mix of lengths is split into the forward passes that cost least (see
    :meth:`passes`), so the caller may hand over whatever it has: a long text never pads a
    short one, and short texts share a pass.
    """

    def __init__(
        self,
        *,
        model_dir: Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        quantize: str | None = None,
        max_batch_tokens: int | None = None,
        pass_overhead_tokens: int | None = None,
        packed: bool = True,
    ) -> None:
        self.device = resolve_device(device)
        gpu = self.device.type == "cuda"
        if max_batch_tokens is None:
            max_batch_tokens = GPU_MAX_BATCH_TOKENS if gpu else DEFAULT_MAX_BATCH_TOKENS
        if pass_overhead_tokens is None:
            pass_overhead_tokens = GPU_PASS_OVERHEAD_TOKENS if gpu else DEFAULT_PASS_OVERHEAD_TOKENS
        if max_batch_tokens < 1 or pass_overhead_tokens < 0:
            raise ModelError(f"max_batch_tokens must be >= 1 and pass_overhead_tokens >= 0, "
                             f"got {max_batch_tokens} and {pass_overhead_tokens}")
        self.max_batch_tokens = max_batch_tokens
        self.pass_overhead_tokens = pass_overhead_tokens
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ArtifactError(f"model directory not found: {model_dir}")
        self.model_dir = model_dir
        self.dtype = dtype
        if quantize not in (None, "int8"):
            raise ModelError(f"unknown quantize mode {quantize!r}; expected 'int8' or None")
        if quantize and (self.device.type != "cpu" or dtype != torch.float32):
            raise ModelError(f"quantize={quantize!r} runs on the CPU in float32, not {self.device} {dtype}")
        self.quantize = quantize
        self.config = BertConfig.from_dir(model_dir)
        self.max_seq_length = self._max_seq_length(model_dir, self.config)

        # Unpadded: each pass pads its own chunk to the chunk's longest text.
        self._tokenizer = self._load_tokenizer(model_dir, self.max_seq_length)

        model = BertEncoder(self.config)
        load_bert_weights(model, model_dir / WEIGHTS_FILE)
        model = model.to(device=self.device, dtype=dtype).eval()
        self.packed = packed and packs(self.device, dtype)
        if self.packed:
            pack_layers(model)
        self.model: nn.Module = model
        if quantize:
            quantize_int8(model, activation_max=self.activation_maxima())

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    @staticmethod
    def _max_seq_length(model_dir: Path, cfg: BertConfig) -> int:
        st_config = model_dir / "sentence_bert_config.json"
        limit = DEFAULT_MAX_SEQ_LENGTH
        if st_config.exists():
            limit = int(read_json(st_config).get("max_seq_length", limit))
        return min(limit, cfg.max_position_embeddings)

    @staticmethod
    def _load_tokenizer(model_dir: Path, max_length: int) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ArtifactError(f"missing tokenizer file: {path}")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise ArtifactError(f"unreadable tokenizer {path}: {exc}") from exc
        # The shipped tokenizer.json pads/truncates to a fixed 128; sentence-transformers
        # overrides that with max_seq_length and dynamic padding, and so do we.
        tok.no_padding()
        tok.enable_truncation(max_length=max_length)
        return tok

    def activation_maxima(self, texts: Sequence[str] = CALIBRATION_TEXTS) -> dict[str, torch.Tensor]:
        """What :func:`quantize_int8` smooths with: each projection's input channel maxima over
        ``texts``, encoded in the passes ``encode`` would run. Call it while still in float."""
        if not isinstance(self.model, BertEncoder) or self.packed:
            raise ModelError("activation maxima are measured on the float BertEncoder, unpacked")
        encs = self._tokenizer.encode_batch(list(texts))
        batches = [self._padded([encs[i].ids for i in chunk], [encs[i].type_ids for i in chunk])
                   for chunk in self.passes([len(e.ids) for e in encs])]
        dev = self.device
        return activation_maxima(self.model, [(ids.to(dev), mask.to(dev), types.to(dev))
                                              for ids, mask, types in batches])

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text after truncation, [CLS] and [SEP] included."""
        return [len(e.ids) for e in self._tokenizer.encode_batch(list(texts))]

    def passes(self, lengths: Sequence[int]) -> list[list[int]]:
        """The forward passes ``encode`` runs for texts of these token lengths (see plan_passes)."""
        return plan_passes(lengths, max_batch_tokens=self.max_batch_tokens,
                           overhead_tokens=self.pass_overhead_tokens)

    def _padded(self, ids: Sequence[Sequence[int]], types: Sequence[Sequence[int]]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(row) for row in ids)
        pad = self.config.pad_token_id
        input_ids = torch.tensor([[*row, *[pad] * (width - len(row))] for row in ids], dtype=torch.long)
        type_ids = torch.tensor([[*row, *[0] * (width - len(row))] for row in types], dtype=torch.long)
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids], dtype=torch.long)
        return input_ids, mask, type_ids

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """Return an (N, dim) float32 CPU tensor of unit-length sentence embeddings.

        It is an inference-mode tensor: ``.clone()`` it before using it in autograd.
        """
        # Gathered on the device and copied once: a copy per pass would wait for the GPU per pass.
        out = torch.empty((len(texts), self.dim), dtype=torch.float32, device=self.device)
        if len(texts) == 0:
            return out.cpu()
        encs = self._tokenizer.encode_batch(list(texts))
        for chunk in self.passes([len(e.ids) for e in encs]):
            ids, mask, types = self._padded([encs[i].ids for i in chunk], [encs[i].type_ids for i in chunk])
            out[chunk] = self.forward_pooled(ids, mask, types)
        return out.cpu()

    def forward_pooled(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        """One forward pass over padded inputs: unit-length float32 vectors, on the model's device."""
        ids, mask, types = (t.to(self.device) for t in (ids, mask, types))
        hidden = self.model(ids, mask, types)
        # Pool in float32: summing up to 256 bf16 vectors loses visible precision.
        m = mask.unsqueeze(-1).to(torch.float32)
        summed = (hidden.to(torch.float32) * m).sum(dim=1)
        pooled = summed / m.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2.0, dim=1)
