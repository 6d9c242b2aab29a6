"""Dynamic int8 for the BERT encoder's projections, with SmoothQuant smoothing.

:func:`quantize_int8` swaps the ``nn.Linear`` projections of a loaded :class:`BertEncoder` for
:class:`DynamicInt8Linear` without a second weights file: the smoothing it needs is calibrated at
load on built-in texts (:data:`CALIBRATION_TEXTS`), through :func:`activation_maxima`.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from sluice.errors import ModelError
from workers.models.bert import LINEAR_NAMES, BertEncoder

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


def quantize_linears(module: nn.Module, *, skip: Collection[str] = ()) -> int:
    """Swap every ``nn.Linear`` below ``module`` for an unsmoothed :class:`DynamicInt8Linear` (a
    model of any architecture, so no calibrated smoothing), except those under a child named in
    ``skip``; answer how many were swapped."""
    reduce_range = needs_reduce_range()
    swapped = 0
    for name, child in list(module.named_children()):
        if name in skip:
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, DynamicInt8Linear(child, reduce_range=reduce_range, first_token_scale=True))
            swapped += 1
        else:
            swapped += quantize_linears(child)
    return swapped
