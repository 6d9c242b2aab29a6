"""A 6-layer BERT encoder in plain torch, as all-MiniLM-L6-v2 has it: the config, the layers, and the
weights read from ``model.safetensors`` (never a pickle).

Every projection is a plain ``nn.Linear`` named in :data:`LINEAR_NAMES`, so
:func:`workers.models.int8.quantize_int8` can swap them for int8 kernels after loading.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from sluice.errors import ArtifactError

WEIGHTS_FILE = "model.safetensors"
LINEAR_NAMES = ("query", "key", "value", "attn_out", "ffn_in", "ffn_out")
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
        raw = read_json(model_dir / "config.json")
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


def read_json(path: Path) -> dict[str, Any]:
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
        # BERT's "gelu" is the exact erf form, nn.GELU's default. A module of its own, so that
        # packing can run it inside ffn_in's kernel (`workers/models/packed.py`).
        self.ffn_act: nn.Module = nn.GELU()
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
        out: torch.Tensor = self.ffn_norm(x + self.ffn_out(self.ffn_act(self.ffn_in(x))))
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
