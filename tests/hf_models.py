"""Tiny Hugging Face model directories built on the spot, for the hf-embedding and hf-classifier
kinds: a 2-layer BERT (hidden 32) with random weights and a small WordPiece vocabulary. Nothing is
downloaded, and transformers is imported only when one is built (tests that merely import these
helpers do not pay for it); a build takes tens of milliseconds.

The vocabulary holds every lowercase letter and digit both as a word start and as a ``##``
continuation, so any English text tokenizes (into many pieces), and a few whole words, so common
texts come out shorter than their letters.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import BertConfig

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
WORDS = ("where", "is", "my", "order", "the", "please", "help", "card", "payment", "declined", "account")
MAX_POSITIONS = 64


def _vocab() -> list[str]:
    chars = string.ascii_lowercase + string.digits
    return [*SPECIALS, *chars, *(f"##{c}" for c in chars), *string.punctuation, *WORDS]


def _config(vocab_size: int, labels: Sequence[str] = ("LABEL_0", "LABEL_1")) -> BertConfig:
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=MAX_POSITIONS,
                      id2label=dict(enumerate(labels)), label2id={label: i for i, label in enumerate(labels)})


def _write_tokenizer(path: Path, vocab: Sequence[str]) -> None:
    from tokenizers import BertWordPieceTokenizer

    # Built with `tokenizers` and described by tokenizer_config.json, so it loads the same under
    # transformers 4 and 5 (whose BertTokenizer constructors differ).
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    BertWordPieceTokenizer({tok: i for i, tok in enumerate(vocab)}, lowercase=True).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 512,
        "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    }), encoding="utf-8")


def build_tiny_encoder(path: Path, *, pooling: str = "mean", normalize: bool = True, seed: int = 0,
                       max_seq_length: int | None = 24) -> Path:
    """A sentence-transformers directory over a tiny BertModel: ``pooling`` is ``"mean"``,
    ``"cls"`` or ``"max"``; ``normalize`` adds a Normalize module; ``max_seq_length`` goes to
    sentence_bert_config.json (None: no such file, so the limit is the 64 positions)."""
    import torch
    from transformers import BertModel

    path.mkdir(parents=True, exist_ok=True)
    vocab = _vocab()
    torch.manual_seed(seed)
    BertModel(_config(len(vocab))).save_pretrained(path)
    _write_tokenizer(path, vocab)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens"}
    pooling_config: dict[str, object] = {"word_embedding_dimension": 32}
    pooling_config.update({mode: name == pooling for name, mode in modes.items()})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config), encoding="utf-8")
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}),
                                                        encoding="utf-8")
    return path


def build_tiny_classifier(path: Path, *, labels: Sequence[str] = ("neg", "pos", "neutral"), seed: int = 0) -> Path:
    """A tiny BertForSequenceClassification directory whose id2label is ``labels`` in order."""
    import torch
    from transformers import BertForSequenceClassification

    path.mkdir(parents=True, exist_ok=True)
    vocab = _vocab()
    torch.manual_seed(seed)
    BertForSequenceClassification(_config(len(vocab), labels)).save_pretrained(path)
    _write_tokenizer(path, vocab)
    return path
