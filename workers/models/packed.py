"""bf16 layers on the CPU, run the way oneDNN runs them fastest.

A bf16 ``nn.Linear`` hands oneDNN its weight in torch's plain layout on every call, and at the
small passes a worker runs between arrivals each call's fixed cost outweighs its arithmetic
(bench/README.md, "bench.packed_layers"). :func:`pack_layers` does what inductor's frozen graphs
do to a :class:`BertLayer`, without their compile time:

* every weight is reordered into oneDNN's blocked layout once, at load (:class:`PackedLinear`);
* the intermediate GELU (BERT's exact erf form) runs inside its projection's kernel as a post-op,
  on the product before it is rounded to bf16.

oneDNN builds (JIT-compiles) and caches a kernel for each weight shape and each row count it is
handed, and a worker's passes come in nearly as many row counts (texts x padded length) as
passes: a process encoding 800 worker-like batches of 1-32 texts of the skewed mix built new kernels
on most passes and grew by about 700 MB. So a packed product runs at its row count rounded up
(:func:`padded_rows`): to a multiple of 16, the rows of an AMX tile, which the kernel pads to
anyway; from 512 rows on, to a 32nd of the row count's power of two, at most 3 % more rows. That
leaves 160 row counts up to 8,192, the kernels a process builds are reused, and the same run grew
by 130 MB with 1.10x less CPU (bench/README.md, "bench.packed_rows").

Query, key and value stay three products. One product over their concatenated weights saved
a few per cent more CPU, but it is a fourth weight shape, and so more kernels to keep: a process
that had seen 200 texts in batches of 1-32 held 85 MB more.

The layers keep the checkpoint's weights; only their layout changes, so the outputs
agree with the plain bf16 layers within bf16's rounding (docs/ARCHITECTURE.md, "Precision per
host"). A model whose architecture is not known here gets :func:`pack_linears`, the layout alone.
fp32 measured no clear gain this way, so only bf16 is packed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.bert import LINEAR_NAMES, BertEncoder, BertLayer


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers of this device and dtype are packed: bf16 on a CPU whose oneDNN runs it."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return bool(torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# An AMX tile holds 16 rows; below 512 rows each step of 16 is one more tile.
TILE_ROWS = 16
# From 512 rows on the step is this fraction of the row count's power of two: at most 1/32 padded.
STEPS_PER_OCTAVE = 32


def padded_rows(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at (see the module's docstring)."""
    step = max(TILE_ROWS, (1 << (rows.bit_length() - 1)) // STEPS_PER_OCTAVE) if rows else TILE_ROWS
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias``, then GELU when ``gelu``, with ``weight`` reordered once into
    oneDNN's blocked layout. The packed weight is an opaque oneDNN tensor: it has no storage to
    save, copy or move, so a packed module is built where it runs and never leaves it. It keeps
    ``nn.Linear``'s attribute names, and its ``weight`` answers ``dtype``, ``shape`` and
    ``device``, which is what model code reads of a projection it does not call. ``exact_rows``
    runs every row count as it comes, for the benchmark that measures what :func:`padded_rows` saves."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, gelu: bool = False,
                 exact_rows: bool = False) -> None:
        super().__init__()
        self.exact_rows = exact_rows
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()
        # "none" names the exact erf GELU among oneDNN's algorithms; a plain product takes "".
        self.post_op, self.algorithm = ("gelu", "none") if gelu else ("none", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        padded = rows if self.exact_rows else padded_rows(rows)
        flat = x.reshape(rows, self.in_features)
        if padded != rows:
            # Zero rows: each row's product is its own, so what they answer is dropped below.
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, self.weight, self.bias, self.post_op, [],
                                                               self.algorithm)
        return out[:rows].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        gelu = ", gelu" if self.post_op == "gelu" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{gelu}"


def pack_layers(model: BertEncoder, *, exact_rows: bool = False) -> None:
    """Pack ``model``'s layers in place: their projections become :class:`PackedLinear`, the GELU
    moves into ``ffn_in``'s kernel, and the plain weights are freed."""
    for layer in model.layers:
        if not isinstance(layer, BertLayer) or isinstance(layer.ffn_in, PackedLinear):
            continue
        for name in LINEAR_NAMES:
            linear = getattr(layer, name)
            setattr(layer, name, PackedLinear(linear.weight, linear.bias, gelu=name == "ffn_in", exact_rows=exact_rows))
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
