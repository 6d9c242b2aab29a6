"""all-MiniLM-L6-v2 in plain torch: a 6-layer BERT encoder, mean pooling, L2 normalisation.

Only ``torch``, ``tokenizers`` and ``safetensors`` are used, so the worker never imports
``transformers``; the weights are read from ``model.safetensors`` (never a pickle).
Every projection is a plain ``nn.Linear``, so :func:`quantize_int8` can swap them for int8
kernels after loading (``quantize="int8"``) without a second weights file: the smoothing it
needs is calibrated at load on built-in texts (:data:`CALIBRATION_TEXTS`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

from sluice.errors import ArtifactError, ModelError

WEIGHTS_FILE = "model.safetensors"
DEFAULT_MAX_SEQ_LENGTH = 256
# How the encoder splits a batch into forward passes (see MiniLMEncoder.passes). On one CPU
# thread a pass costs about 25 tokens' worth beyond its padded tokens (13.5 ms for one text of
# 18 tokens, 98 ms for 16 of them), and past a few thousand padded tokens its activations leave
# the cache and every token costs more.
DEFAULT_PASS_OVERHEAD_TOKENS = 24
DEFAULT_MAX_BATCH_TOKENS = 2048
LINEAR_NAMES = ("query", "key", "value", "attn_out", "ffn_in", "ffn_out")
# The FFN down-projection reads GELU outputs whose few large values (up to 25 where most
# channels stay under 2) set the activation scale, and smoothing does not tame them (alone in
# int8, at best min cosine 0.998). Kept in fp32, int8 stays at cosine >= 0.999 to fp32 on every
# text of the skewed mix: 200 texts of seed 7, min 0.9992, mean 0.9996 (seed 1: min 0.9992);
# every projection int8: min 0.996, mean 0.998. In CPU time on one thread that is 1.8x fp32's
# speed (every projection int8: 2.9-3.3x; `python -m bench.quantized`, 96 texts, 3 repeats).
DEFAULT_FP32_LINEARS = ("ffn_out",)
# SmoothQuant's migration strength: input channel j of a projection is divided by
# s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) and the weight's column j multiplied by it, so
# outlier channels (LayerNorm outputs reach 28 where most channels stay under 2) no longer set
# the one activation scale of a call. Min cosine to fp32 over 200 texts of the skewed mix
# (seeds 7 and 1): 0.4: 0.9991/0.9990, 0.5: 0.9992/0.9993, 0.6: 0.9993/0.9993, 0.7: 0.9993/
# 0.9989; without smoothing 0.9970 on seed 7, smoothing without [CLS]'s own scale 0.9967.
SMOOTHING_ALPHA = 0.5
# What the activation maxima are calibrated on at load (fp32, well under a second of CPU):
# short requests of several kinds and one text past 256 tokens, so every position is seen.
# Fixed here, so that every worker smooths alike; none of them is a benchmark or test text.
_CALIBRATION_SENTENCES = (
    "How do I reset my password?",
    "The quarterly report shows revenue grew by 12% compared with last year.",
    "Can you recommend a good Italian restaurant near the train station?",
    "My package was supposed to arrive on Monday but it still hasn't shown up.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "I'd like to cancel my subscription, please.",
    "What's the weather going to be like this weekend in Berlin?",
    "The patient was admitted with chest pain and shortness of breath.",
    "She plays the violin in a small orchestra every Thursday evening.",
    "Error 504: the gateway timed out while waiting for the upstream server.",
    "Thanks a lot, that fixed it!",
    "Refund request for order #48213, item arrived damaged.",
)
CALIBRATION_TEXTS: tuple[str, ...] = (
    *_CALIBRATION_SENTENCES,
    " ".join(_CALIBRATION_SENTENCES + tuple(reversed(_CALIBRATION_SENTENCES))),
    " ".join(_CALIBRATION_SENTENCES[::2] * 3),
)


@dataclass(frozen=True, slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int

    @classmethod
    def from_dir(cls, model_dir: Path) -> BertConfig:
        raw = _read_json(model_dir / "config.json")
        if raw.get("model_type", "bert") != "bert":
            raise ArtifactError(f"{model_dir}: model_type {raw.get('model_type')!r} is not bert")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ArtifactError(f"{model_dir}: hidden_act {raw.get('hidden_act')!r} unsupported")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ArtifactError(f"{model_dir}: only absolute position embeddings are supported")
        try:
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                intermediate_size=int(raw["intermediate_size"]),
                max_position_embeddings=int(raw["max_position_embeddings"]),
                type_vocab_size=int(raw.get("type_vocab_size", 2)),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                pad_token_id=int(raw.get("pad_token_id", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{model_dir}/config.json is incomplete: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ArtifactError(f"missing model file: {path}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"unreadable model file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    return data


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word(input_ids) + self.token_type(token_type_ids) + self.position(positions)
        out: torch.Tensor = self.norm(x)
        return out


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ArtifactError("hidden_size is not a multiple of num_attention_heads")
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        # Separate q/k/v projections (not one fused matrix) keep the checkpoint's layout and
        # stay plain nn.Linear for dynamic quantisation.
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.intermediate_size)
        self.ffn_out = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        return x.view(b, n, self.heads, h // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        ctx = ctx.transpose(1, 2).reshape(b, n, h)
        x = self.attn_norm(x + self.attn_out(ctx))
        # BERT's "gelu" is the exact erf form, which is F.gelu's default.
        out: torch.Tensor = self.ffn_norm(x + self.ffn_out(F.gelu(self.ffn_in(x))))
        return out


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        x: torch.Tensor = self.embeddings(input_ids, token_type_ids)
        # Boolean mask, True = may attend; shape (B, 1, 1, N) broadcasts over heads and queries.
        # Every row keeps its [CLS], so no query row is fully masked (which would yield NaN).
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x


# Checkpoint (Hugging Face BertModel) name fragments -> this module's names.
_RENAMES: tuple[tuple[str, str], ...] = (
    ("embeddings.word_embeddings.", "embeddings.word."),
    ("embeddings.position_embeddings.", "embeddings.position."),
    ("embeddings.token_type_embeddings.", "embeddings.token_type."),
    ("embeddings.LayerNorm.", "embeddings.norm."),
    ("encoder.layer.", "layers."),
    (".attention.self.query.", ".query."),
    (".attention.self.key.", ".key."),
    (".attention.self.value.", ".value."),
    (".attention.output.dense.", ".attn_out."),
    (".attention.output.LayerNorm.", ".attn_norm."),
    (".intermediate.dense.", ".ffn_in."),
    (".output.dense.", ".ffn_out."),
    (".output.LayerNorm.", ".ffn_norm."),
)
# Present in the checkpoint but unused by a sentence encoder.
_IGNORED_PREFIXES = ("pooler.", "embeddings.position_ids")


def _rename(key: str) -> str:
    for old, new in _RENAMES:
        key = key.replace(old, new)
    return key


def load_bert_weights(model: BertEncoder, weights: Path) -> None:
    """Load a BertModel safetensors checkpoint into ``model``, strictly."""
    try:
        raw = load_file(str(weights), device="cpu")
    except FileNotFoundError as exc:
        raise ArtifactError(f"missing weights file: {weights}") from exc
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"unreadable safetensors file {weights}: {exc}") from exc
    state = {
        _rename(k.removeprefix("bert.")): v
        for k, v in raw.items()
        if not k.removeprefix("bert.").startswith(_IGNORED_PREFIXES)
    }
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ArtifactError(f"{weights} does not match the BERT config: {exc}") from exc


class DynamicInt8Linear(nn.Module):
    """``nn.Linear`` with int8 weights (symmetric, one scale per output channel) and activations
    quantized per call, run by torch's fused CPU kernel.

    The kernel gives the activations of a call one scale, so its largest value decides how finely
    every other one is quantized. Two things keep that value down:

    * ``smoothing`` (SmoothQuant): the input is divided by it channel-wise and the weight's
      columns multiplied by it, so that ``x @ W.T`` is unchanged but outlier channels shrink;
    * ``first_token_scale``: for (batch, tokens, features) inputs the first token of each row
      ([CLS] in BERT, whose activations run several times larger than any other token's in the
      early layers) is quantized in a call of its own, with its own scale.

    ``reduce_range`` quantizes activations to 7 bits: x86 kernels without VNNI accumulate pairs
    of u8 x s8 products in saturating int16, which 8-bit activations can overflow. torch's own
    ``quantize_dynamic`` modules always pass True, which costs MiniLM much of its agreement
    with fp32 (smoothed as :class:`MiniLMEncoder` does, min cosine 0.997-0.998 and mean 0.999
    instead of 0.9992 and 0.9996 on the skewed mix); this class asks only where it is needed.
    """

    def __init__(self, linear: nn.Linear, *, reduce_range: bool, smoothing: torch.Tensor | None = None,
                 first_token_scale: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.reduce_range = reduce_range
        self.first_token_scale = first_token_scale
        weight = linear.weight.detach().to(torch.float32)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32)
        self._inv_smoothing: torch.Tensor | None = None
        if smoothing is not None:
            smoothing = smoothing.detach().to(torch.float32)
            if smoothing.shape != (self.in_features,) or not bool((smoothing > 0).all()):
                raise ModelError(f"smoothing must be {self.in_features} positive factors")
            weight = weight * smoothing
            self._inv_smoothing = smoothing.reciprocal()
        # 127, not 127.5: the largest weight of each row maps to +-127 exactly, never clipped.
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=2.0**-24).to(torch.float64)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
        with warnings.catch_warnings():
            # torch.quantize_per_channel warns that quantized tensors are deprecated, but the
            # packed fbgemm/oneDNN weights still need one (torch is pinned in pyproject.toml).
            warnings.filterwarnings("ignore", message=r".*quantize_per_channel.*deprecated", category=UserWarning)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = self.first_token_scale and x.dim() == 3 and x.shape[1] > 1
        if self._inv_smoothing is not None:
            x = x * self._inv_smoothing
        elif split:
            x = x.clone()  # the first tokens are zeroed below
        if not split:
            out: torch.Tensor = torch.ops.quantized.linear_dynamic(x, self._packed, self.reduce_range)
            return out
        first = torch.ops.quantized.linear_dynamic(x[:, 0], self._packed, self.reduce_range)
        # A zero is inside every range the kernel picks, so zeroed rows leave the others' scale
        # alone; their outputs (the bias) are overwritten. Cheaper than slicing out the rest.
        x[:, 0] = 0.0
        out = torch.ops.quantized.linear_dynamic(x, self._packed, self.reduce_range)
        out[:, 0] = first
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"reduce_range={self.reduce_range}, smoothed={self._inv_smoothing is not None}, "
                f"first_token_scale={self.first_token_scale}")


def needs_reduce_range() -> bool:
    """True where 8-bit activations could overflow the int8 kernel (x86 without AVX512-VNNI)."""
    if torch.backends.quantized.engine not in ("x86", "fbgemm", "onednn"):
        return False  # qnnpack ignores it (and warns on every call when asked)
    is_vnni = getattr(torch.cpu, "_is_vnni_supported", None)  # torch's own test, private
    return not (callable(is_vnni) and is_vnni())


@torch.inference_mode()
def activation_maxima(model: BertEncoder, batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                      ) -> dict[str, torch.Tensor]:
    """Per input channel, the largest |activation| each projection sees over ``batches`` of
    (input_ids, attention_mask, token_type_ids), keyed ``"<layer>.<name>"`` (``"0.query"``).

    Run on the float model, before :func:`quantize_int8`; padding positions count too, as they
    do in the activations the int8 kernels later quantize.
    """
    maxima: dict[str, torch.Tensor] = {}

    def hook(key: str) -> Any:
        def record(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach()
            seen = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).to(torch.float32)
            maxima[key] = seen if key not in maxima else torch.maximum(maxima[key], seen)
        return record

    handles = [getattr(layer, name).register_forward_pre_hook(hook(f"{i}.{name}"))
               for i, layer in enumerate(model.layers) for name in LINEAR_NAMES
               if isinstance(getattr(layer, name), nn.Linear)]
    try:
        for ids, mask, types in batches:
            model(ids, mask, types)
    finally:
        for handle in handles:
            handle.remove()
    return maxima


def smoothing_factors(activation_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA
                      ) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors: max|X_j|^alpha / max|W_:,j|^(1 - alpha)."""
    weight_max = weight.detach().abs().amax(dim=0).to(torch.float32).clamp(min=1e-5)
    factors = activation_max.to(torch.float32).clamp(min=1e-5).pow(alpha) / weight_max.pow(1.0 - alpha)
    return factors.clamp(min=1e-5)


def quantize_int8(model: BertEncoder, *, fp32_linears: Collection[str] = DEFAULT_FP32_LINEARS,
                  reduce_range: bool | None = None, activation_max: Mapping[str, torch.Tensor] | None = None,
                  alpha: float = SMOOTHING_ALPHA, first_token_scale: bool = True) -> None:
    """Swap the encoder's projections, except those named in ``fp32_linears``, for int8 ones.

    ``activation_max`` (from :func:`activation_maxima` on calibration texts) turns on SmoothQuant
    smoothing with strength ``alpha`` for every projection it has maxima for; without it the
    activations are quantized as they come. ``first_token_scale`` gives each [CLS] token its own
    activation scale (see :class:`DynamicInt8Linear`). :class:`MiniLMEncoder` with
    ``quantize="int8"`` does all of it.

    ``reduce_range`` defaults to what this CPU needs; a bench that emulates a CPU without VNNI
    (its instruction sets limited by environment variables) must ask for 7 bits itself.
    """
    unknown = set(fp32_linears) - set(LINEAR_NAMES)
    if unknown:
        raise ModelError(f"unknown linear names {sorted(unknown)}; expected some of {LINEAR_NAMES}")
    if not 0.0 <= alpha <= 1.0:
        raise ModelError(f"alpha must be within [0, 1], got {alpha}")
    if reduce_range is None:
        reduce_range = needs_reduce_range()
    for i, layer in enumerate(model.layers):
        for name in LINEAR_NAMES:
            if name in fp32_linears:
                continue
            linear = getattr(layer, name)
            seen = None if activation_max is None else activation_max.get(f"{i}.{name}")
            smoothing = None if seen is None else smoothing_factors(seen, linear.weight, alpha)
            setattr(layer, name, DynamicInt8Linear(linear, reduce_range=reduce_range, smoothing=smoothing,
                                                   first_token_scale=first_token_scale))


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
    them: O(n^2) for a batch of n, a few hundred steps for 32.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ranked = [lengths[i] for i in order]
    # best[j]: least cost of the j shortest texts; start[j]: where the last of its passes starts.
    best = [0] * (len(order) + 1)
    start = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        width = ranked[end - 1]
        best[end] = -1
        for first in range(end - 1, -1, -1):
            size = end - first
            if size > 1 and size * width > max_batch_tokens:
                break
            cost = best[first] + overhead_tokens + size * width
            if best[end] < 0 or cost < best[end]:
                best[end], start[end] = cost, first
    passes: list[list[int]] = []
    end = len(order)
    while end:
        passes.append(order[start[end]:end])
        end = start[end]
    passes.reverse()
    return passes


class MiniLMEncoder:
    """Sentence encoder with the same outputs as sentence-transformers' all-MiniLM-L6-v2.

    ``encode`` pads each batch only to its own longest text, so callers that batch by length
    pay for no padding beyond that; it returns float32 vectors on the CPU. ``quantize="int8"``
    runs the projections as dynamic int8 (CPU and float32 only; see :func:`quantize_int8`),
    smoothed with activation maxima measured at load on :data:`CALIBRATION_TEXTS`.

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
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        pass_overhead_tokens: int = DEFAULT_PASS_OVERHEAD_TOKENS,
    ) -> None:
        if max_batch_tokens < 1 or pass_overhead_tokens < 0:
            raise ModelError(f"max_batch_tokens must be >= 1 and pass_overhead_tokens >= 0, "
                             f"got {max_batch_tokens} and {pass_overhead_tokens}")
        self.max_batch_tokens = max_batch_tokens
        self.pass_overhead_tokens = pass_overhead_tokens
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ArtifactError(f"model directory not found: {model_dir}")
        self.model_dir = model_dir
        self.device = resolve_device(device)
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
            limit = int(_read_json(st_config).get("max_seq_length", limit))
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
        if not isinstance(self.model, BertEncoder):
            raise ModelError("activation maxima are measured on the float BertEncoder")
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
        out = torch.empty((len(texts), self.dim), dtype=torch.float32)
        if len(texts) == 0:
            return out
        encs = self._tokenizer.encode_batch(list(texts))
        for chunk in self.passes([len(e.ids) for e in encs]):
            ids, mask, types = self._padded([encs[i].ids for i in chunk], [encs[i].type_ids for i in chunk])
            out[chunk] = self._forward(ids, mask, types)
        return out

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        ids, mask, types = (t.to(self.device) for t in (ids, mask, types))
        hidden = self.model(ids, mask, types)
        # Pool in float32: summing up to 256 bf16 vectors loses visible precision.
        m = mask.unsqueeze(-1).to(torch.float32)
        summed = (hidden.to(torch.float32) * m).sum(dim=1)
        pooled = summed / m.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2.0, dim=1).cpu()
