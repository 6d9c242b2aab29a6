"""hf-embedding and hf-classifier over tiny BERTs built on the spot (tests/hf_models.py).

Every output is checked against transformers run directly, one text at a time (so without
padding): pooling, normalisation, truncation and label order, and that a batch of mixed lengths,
padded to its longest, answers what each text answers alone. Refusals check the directory is
never handed to transformers when it holds a pickle or asks for its own code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from sluice.errors import ArtifactError, InferenceError
from sluice.kinds import ModelKind
from tests.hf_models import MAX_POSITIONS, build_tiny_classifier, build_tiny_encoder
from workers.models.hf import load_hf_classifier, load_hf_embedding
from workers.models.protocol import ModelHandler
from workers.models.synthetic import POISON_TEXT

TEXTS = [
    "where is my order",
    "Hi!",
    "please help me understand why my card payment was declined at the store today",
    "account 42",
    "the order",
]
# 100+ pieces: past both the 24 of sentence_bert_config.json and the 64 positions.
LONG = "xylophones quietly juxtapose " * 8
TOL = 1e-5


def _direct_hidden(model_dir: Path, text: str, max_length: int) -> torch.Tensor:
    """transformers alone on one text: its last hidden state, (tokens, hidden)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.inference_mode():
        batch = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
        hidden: torch.Tensor = model(**batch).last_hidden_state[0]
    return hidden


def _embeddings(handler: Any, texts: list[str]) -> torch.Tensor:
    return torch.tensor([out["embedding"] for out in handler.run([{"text": t} for t in texts])])


def _check_pooling(model_dir: Path, pool: Callable[[torch.Tensor], torch.Tensor], *, normalize: bool,
                   max_length: int, texts: list[str] = TEXTS) -> torch.Tensor:
    handler = load_hf_embedding(model_dir, device="cpu")
    assert handler.max_length == max_length
    got = _embeddings(handler, texts)
    expected = torch.stack([pool(_direct_hidden(model_dir, t, max_length)) for t in texts])
    if normalize:
        expected = F.normalize(expected, dim=-1)
    assert got.shape == (len(texts), 32)
    assert torch.allclose(got, expected, atol=TOL), (got - expected).abs().max()
    return got


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_encoder(tmp_path_factory.mktemp("hf") / "mean")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("hf") / "cls", labels=("neg", "pos", "neutral"))


def test_mean_pooling_normalised_matches_transformers(encoder_dir: Path) -> None:
    got = _check_pooling(encoder_dir, lambda h: h.mean(dim=0), normalize=True, max_length=24, texts=[*TEXTS, LONG])
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(got)), atol=TOL)


def test_cls_pooling_without_normalize_matches_transformers(tmp_path: Path) -> None:
    model_dir = build_tiny_encoder(tmp_path / "enc", pooling="cls", normalize=False, seed=1)
    got = _check_pooling(model_dir, lambda h: h[0], normalize=False, max_length=24)
    # Unnormalised: the check above would also pass on unit vectors if these were normalised.
    assert (got.norm(dim=-1) - 1).abs().min() > 1e-3


def test_max_pooling_matches_transformers(tmp_path: Path) -> None:
    model_dir = build_tiny_encoder(tmp_path / "enc", pooling="max", seed=2)
    _check_pooling(model_dir, lambda h: h.amax(dim=0), normalize=True, max_length=24)


def test_without_sentence_transformers_files_mean_pooling_and_position_limit(tmp_path: Path) -> None:
    model_dir = build_tiny_encoder(tmp_path / "enc", max_seq_length=None, seed=3)
    (model_dir / "modules.json").unlink()
    # No sentence_bert_config.json: the tokenizer says 512, the position table holds 64.
    got = _check_pooling(model_dir, lambda h: h.mean(dim=0), normalize=False, max_length=MAX_POSITIONS,
                         texts=[*TEXTS, LONG])
    assert (got.norm(dim=-1) - 1).abs().min() > 1e-3


def test_truncation_keeps_the_first_tokens(encoder_dir: Path) -> None:
    handler = load_hf_embedding(encoder_dir, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir, local_files_only=True)
    ids = tokenizer(LONG)["input_ids"]
    assert len(ids) > 24
    # The text made of the first 22 pieces (24 with [CLS] and [SEP]) embeds the same.
    head = str(tokenizer.decode(ids[1:23]))
    long_vec, head_vec, other = _embeddings(handler, [LONG, head, LONG[5:]])
    assert torch.allclose(long_vec, head_vec, atol=TOL)
    assert not torch.allclose(long_vec, other, atol=1e-3)


def test_mixed_lengths_batch_equals_one_by_one(encoder_dir: Path, classifier_dir: Path) -> None:
    texts = [TEXTS[1], LONG, TEXTS[0], TEXTS[2], TEXTS[1]]
    embedder = load_hf_embedding(encoder_dir, device="cpu")
    batched = _embeddings(embedder, texts)
    alone = torch.cat([_embeddings(embedder, [t]) for t in texts])
    assert torch.allclose(batched, alone, atol=TOL)
    classifier = load_hf_classifier(classifier_dir, device="cpu")
    batched_scores = [list(out["scores"].values()) for out in classifier.run([{"text": t} for t in texts])]
    alone_scores = [list(classifier.run([{"text": t}])[0]["scores"].values()) for t in texts]
    assert torch.allclose(torch.tensor(batched_scores), torch.tensor(alone_scores), atol=TOL)


def test_classifier_labels_in_index_order_and_softmax_scores(classifier_dir: Path) -> None:
    handler = load_hf_classifier(classifier_dir, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir, local_files_only=True).eval()
    outs = handler.run([{"text": t} for t in TEXTS])
    for text, out in zip(TEXTS, outs, strict=True):
        assert list(out["scores"]) == ["neg", "pos", "neutral"]
        assert sum(out["scores"].values()) == pytest.approx(1.0, abs=TOL)
        with torch.inference_mode():
            probs = torch.softmax(model(**tokenizer([text], return_tensors="pt")).logits[0], dim=-1)
        assert list(out["scores"].values()) == pytest.approx(probs.tolist(), abs=TOL)
        assert out["label"] == ["neg", "pos", "neutral"][int(probs.argmax())]
        assert all(round(p, 6) == p for p in out["scores"].values())


def test_classifier_label_names_follow_id2label(tmp_path: Path) -> None:
    labels = ("zeta", "alpha", "mid", "beta")
    handler = load_hf_classifier(build_tiny_classifier(tmp_path / "c", labels=labels, seed=4), device="cpu")
    assert handler.labels == list(labels)
    (out,) = handler.run([{"text": "where is my order"}])
    assert list(out["scores"]) == list(labels)
    assert out["label"] == max(out["scores"], key=out["scores"].__getitem__)


def test_handlers_satisfy_the_worker_protocol(encoder_dir: Path, classifier_dir: Path) -> None:
    embedder = load_hf_embedding(encoder_dir, device="cpu")
    classifier = load_hf_classifier(classifier_dir, device="cpu")
    for handler, kind in ((embedder, ModelKind.hf_embedding), (classifier, ModelKind.hf_classifier)):
        assert isinstance(handler, ModelHandler)
        assert handler.kind == kind
        assert handler.length_buckets is True
        assert not handler.model.training
        assert handler.passes([{"text": "a"}, {"text": "b"}, {"text": "c"}]) == [[0, 1, 2]]
        assert handler.run([]) == []
        handler.warmup()
    (out,) = embedder.run([{"text": "hi"}])
    assert out["dim"] == len(out["embedding"]) == 32


@pytest.mark.parametrize("bad", [{"text": POISON_TEXT}, {"tokens": 3}, "not a dict"])
def test_bad_input_fails_the_batch_with_inference_error(encoder_dir: Path, classifier_dir: Path, bad: Any) -> None:
    for handler in (load_hf_embedding(encoder_dir, device="cpu"), load_hf_classifier(classifier_dir, device="cpu")):
        with pytest.raises(InferenceError):
            handler.run([{"text": "fine"}, bad])


def test_model_runtime_error_becomes_inference_error(encoder_dir: Path) -> None:
    handler = load_hf_embedding(encoder_dir, device="cpu")

    def broken(**_: Any) -> None:
        raise RuntimeError("out of memory")

    handler.model = broken  # type: ignore[assignment]
    with pytest.raises(InferenceError, match="out of memory"):
        handler.run([{"text": "fine"}])


# --- refusals -----------------------------------------------------------------------------------


def _edit_json(path: Path, **changes: Any) -> None:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_pickled_weights_only_are_refused(tmp_path: Path) -> None:
    model_dir = build_tiny_encoder(tmp_path / "enc")
    (model_dir / "model.safetensors").unlink()
    # Not a valid pickle either: reading it at all would raise something other than the refusal.
    (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04 not a pickle")
    for load in (load_hf_embedding, load_hf_classifier):
        with pytest.raises(ArtifactError, match=r"no model\.safetensors.*pytorch_model\.bin") as exc:
            load(model_dir, device="cpu")
        assert str(model_dir) in str(exc.value)


@pytest.mark.parametrize("config_name", ["config.json", "tokenizer_config.json"])
def test_remote_code_is_refused(tmp_path: Path, config_name: str) -> None:
    model_dir = build_tiny_classifier(tmp_path / "c")
    _edit_json(model_dir / config_name, auto_map={"AutoModel": "modeling_evil.EvilModel"})
    (model_dir / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ArtifactError, match=f"{config_name} has auto_map"):
        load_hf_classifier(model_dir, device="cpu")


def test_missing_or_unreadable_config_is_refused(tmp_path: Path) -> None:
    model_dir = build_tiny_encoder(tmp_path / "enc")
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="unreadable config.json"):
        load_hf_embedding(model_dir, device="cpu")
    (model_dir / "config.json").unlink()
    with pytest.raises(ArtifactError, match="missing config.json"):
        load_hf_embedding(model_dir, device="cpu")


def test_missing_tokenizer_is_refused(tmp_path: Path) -> None:
    model_dir = build_tiny_encoder(tmp_path / "enc")
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "vocab.txt").unlink()
    with pytest.raises(ArtifactError, match="no tokenizer files"):
        load_hf_embedding(model_dir, device="cpu")


def test_not_a_directory_is_refused(tmp_path: Path) -> None:
    weights = build_tiny_encoder(tmp_path / "enc") / "model.safetensors"
    for path in (weights, tmp_path / "absent"):
        with pytest.raises(ArtifactError, match="must be a directory"):
            load_hf_embedding(path, device="cpu")


def test_transformers_load_errors_become_artifact_errors(tmp_path: Path) -> None:
    corrupt = build_tiny_encoder(tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"garbage" * 10)
    unknown = build_tiny_encoder(tmp_path / "unknown")
    _edit_json(unknown / "config.json", model_type="no-such-architecture")
    mismatched = build_tiny_encoder(tmp_path / "mismatched")
    _edit_json(mismatched / "config.json", hidden_size=64)
    for model_dir in (corrupt, unknown, mismatched):
        with pytest.raises(ArtifactError, match="transformers cannot load it"):
            load_hf_embedding(model_dir, device="cpu")


def test_classifier_without_its_head_weights_is_refused(encoder_dir: Path) -> None:
    # A BertModel checkpoint loads as a classifier only with a randomly initialised head.
    with pytest.raises(ArtifactError, match=r"lacks weights the model needs: classifier\."):
        load_hf_classifier(encoder_dir, device="cpu")


def test_multi_label_or_regression_classifier_is_refused(tmp_path: Path) -> None:
    multi_label = build_tiny_classifier(tmp_path / "multi")
    _edit_json(multi_label / "config.json", problem_type="multi_label_classification")
    regression = build_tiny_classifier(tmp_path / "regression", labels=("score",))
    for model_dir in (multi_label, regression):
        with pytest.raises(ArtifactError, match="not single-label"):
            load_hf_classifier(model_dir, device="cpu")


def test_unsupported_sentence_transformers_modules_are_refused(tmp_path: Path) -> None:
    dense = build_tiny_encoder(tmp_path / "dense")
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ArtifactError, match="Dense"):
        load_hf_embedding(dense, device="cpu")
    sqrt = build_tiny_encoder(tmp_path / "sqrt")
    _edit_json(sqrt / "1_Pooling" / "config.json", pooling_mode_mean_tokens=False,
               pooling_mode_mean_sqrt_len_tokens=True)
    with pytest.raises(ArtifactError, match="pooling_mode_mean_sqrt_len_tokens"):
        load_hf_embedding(sqrt, device="cpu")
    no_pooling = build_tiny_encoder(tmp_path / "no_pooling")
    (no_pooling / "modules.json").write_text(json.dumps(modules[:1]))
    with pytest.raises(ArtifactError, match="no sentence_transformers.models.Pooling module"):
        load_hf_embedding(no_pooling, device="cpu")
