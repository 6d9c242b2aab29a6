"""bf16 layers on the CPU, run the way oneDNN runs them fastest.

A bf16 ``nn.Linear`` hands oneDNN its weight in torch's plain layout on every call, and at the
small passes a worker runs between arrivals each call's fixed cost outweighs its arithmetic
(bench/README.md, "bench.packed_layers"). :func:`pack_layers` does what inductor's frozen graphs
do to a :class:`BertLayer`, without their compile time:

* every weight is reordered into oneDNN's blocked layout once, at load (:class:`PackedLinear`);
* the intermediate GELU (BERT's exact erf form) runs inside its projection's kernel as a post-op,
  on the product before it is rounded to bf16.

Query, key and value stay three products. One product over their concatenated weights saved
a few per cent more CPU, but it is a fourth weight shape, and oneDNN caches a kernel per weight
shape and pass shape: a process that had seen 200 texts in batches of 1-32 held 85 MB more
(bench/README.md, "bench.packed_layers").

The layers keep the checkpoint's weights; only their layout changes, so the outputs
agree with the plain bf16 layers within bf16's rounding (docs/ARCHITECTURE.md, "Precision per
host"). A model whose architecture is not known here gets :func:`pack_linears`, the layout alone.
fp32 measured no clear gain this way, so only bf16 is packed.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.models.bert import LINEAR_NAMES, BertEncoder, BertLayer


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers of this device and dtype are packed: bf16 on a CPU whose oneDNN runs it."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return bool(torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias``, then GELU when ``gelu``, with ``weight`` reordered once into
    oneDNN's blocked layout. The packed weight is an opaque oneDNN tensor: it has no storage to
    save, copy or move, so a packed module is built where it runs and never leaves it. It keeps
    ``nn.Linear``'s attribute names, and its ``weight`` answers ``dtype``, ``shape`` and
    ``device``, which is what model code reads of a projection it does not call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, gelu: bool = False) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()
        # "none" names the exact erf GELU among oneDNN's algorithms; a plain product takes "".
        self.post_op, self.algorithm = ("gelu", "none") if gelu else ("none", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.post_op, [],
                                                               self.algorithm)
        return out

    def extra_repr(self) -> str:
        gelu = ", gelu" if self.post_op == "gelu" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{gelu}"


def pack_layers(model: BertEncoder) -> None:
    """Pack ``model``'s layers in place: their projections become :class:`PackedLinear`, the GELU
    moves into ``ffn_in``'s kernel, and the plain weights are freed."""
    for layer in model.layers:
        if not isinstance(layer, BertLayer) or isinstance(layer.ffn_in, PackedLinear):
            continue
        for name in LINEAR_NAMES:
            linear = getattr(layer, name)
            setattr(layer, name, PackedLinear(linear.weight, linear.bias, gelu=name == "ffn_in"))
        layer.ffn_act = nn.Identity()


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 ``nn.Linear`` of ``model`` (a Hugging Face model, say) for a
    :class:`PackedLinear`, in place, and answer how many. Only the weights' layout changes: fusing
    an activation, as :func:`pack_layers` does, needs a known architecture."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(module, name, PackedLinear(child.weight, child.bias))
                swapped += 1
    return swapped
