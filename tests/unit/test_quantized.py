"""The int8 MiniLM option: ``?quantize=`` artifact URIs, loading, agreement with fp32, and what
``auto`` and an explicit int8 do with the start-up calibration."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.batch_plans import sorted_batches
from scheduler.planning.text_mix import skewed_texts
from sluice.artifacts import (
    INTENT_HEAD_URI,
    MINILM_URI,
    ArtifactRef,
    artifact_sha256,
    parse_artifact,
    resolve_artifact,
)
from sluice.errors import ArtifactError, ArtifactMismatch, ModelError
from tests.support import measured_precisions
from workers.models.bert import BertConfig, BertEncoder
from workers.models.calibration import host_precisions
from workers.models.int8 import DEFAULT_FP32_LINEARS, DynamicInt8Linear, needs_reduce_range, quantize_int8
from workers.models.loading import ClassifierHandler, EmbeddingHandler, load_handler
from workers.models.minilm import MiniLMEncoder
from workers.models.precision import PrecisionPolicy, candidates
from workers.models.train_intent import load_examples, split_examples

INT8_URI = f"{MINILM_URI}?quantize=int8"

# bench.quantized on the skewed mix (1 thread, sorted batches of 32), 200 texts, with smoothing
# and [CLS]'s own scale: mean cosine 0.9996, min 0.9992 where VNNI allows 8-bit activations;
# forcing 7-bit activations (what a CPU without VNNI gets) measured mean 0.9989, min 0.9981 on
# 64 texts. The bars sit well below both.
BARS = {"8-bit": (0.99, 0.975), "7-bit": (0.975, 0.95)}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_artifact(MINILM_URI)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return skewed_texts(64, seed=3)


def encode_sorted(encoder: MiniLMEncoder, texts: list[str]) -> torch.Tensor:
    out = torch.empty((len(texts), encoder.dim))
    for batch in sorted_batches(encoder.token_lengths(texts), 32):
        out[batch] = encoder.encode([texts[i] for i in batch])
    return out


# --- artifact URIs (no model) -------------------------------------------------------------------


def test_parse_artifact_options() -> None:
    assert parse_artifact(INT8_URI) == ArtifactRef(location=MINILM_URI, precision="int8")
    assert parse_artifact(MINILM_URI) == ArtifactRef(location=MINILM_URI)
    assert parse_artifact("file:///m/dir?quantize=int8") == ArtifactRef(location="file:///m/dir", precision="int8")
    # `quantize` is the older spelling of `precision`, with the same values.
    for option in ("precision", "quantize"):
        for mode in ("auto", "fp32", "bf16", "fp16", "int8"):
            assert parse_artifact(f"{MINILM_URI}?{option}={mode}") == ArtifactRef(location=MINILM_URI, precision=mode)
    # A plain path may contain "?", and synthetic URIs carry their own parameters.
    assert parse_artifact("/data/what?quantize=int8").location == "/data/what?quantize=int8"
    assert parse_artifact("synthetic:?fixed_s=0.1").location == "synthetic:?fixed_s=0.1"
    for bad in (f"{MINILM_URI}?quantize=int4", f"{MINILM_URI}?dtype=int8",
                f"{MINILM_URI}?quantize=int8&quantize=int8", f"{MINILM_URI}?quantize=",
                f"{MINILM_URI}?precision=bf16&quantize=bf16", f"{MINILM_URI}?precision=half"):
        with pytest.raises(ArtifactError):
            parse_artifact(bad)


def test_options_do_not_change_path_or_hash(model_dir: Path) -> None:
    assert resolve_artifact(INT8_URI) == model_dir
    assert artifact_sha256(resolve_artifact(INT8_URI)) == artifact_sha256(model_dir)


def test_int8_uri_is_still_hash_checked() -> None:
    with pytest.raises(ArtifactMismatch):
        load_handler(kind="embedding", artifact=INT8_URI, sha256="0" * 64)
    with pytest.raises(ArtifactError):
        load_handler(kind="embedding", artifact=f"{MINILM_URI}?quantize=int4", sha256="0" * 64)


# --- loading and agreement (the real model) -----------------------------------------------------


@pytest.mark.model
def test_int8_version_loads_and_agrees_with_fp32(model_dir: Path, texts: list[str]) -> None:
    fp32 = MiniLMEncoder(model_dir=model_dir)
    before = encode_sorted(fp32, texts)

    handler = load_handler(kind="embedding", artifact=INT8_URI, sha256=artifact_sha256(model_dir),
                           precision=PrecisionPolicy(rounds=1))
    assert isinstance(handler, EmbeddingHandler)
    encoder = handler.encoder
    assert encoder.quantize == "int8"
    # An explicit int8 is measured against fp32 at load, so the worker can report what it buys.
    assert handler.precision is not None
    assert (handler.precision.requested, handler.precision.precision) == ("int8", "int8")
    assert handler.precision.speedup is not None and handler.precision.speedup > 0
    layers = list(encoder.model.layers)
    for name in ("query", "key", "value", "attn_out", "ffn_in", "ffn_out"):
        expected = nn.Linear if name in DEFAULT_FP32_LINEARS else DynamicInt8Linear
        assert all(type(getattr(layer, name)) is expected for layer in layers), name
    handler.warmup()
    out = handler.run([{"text": t} for t in texts[:3]])
    assert [o["dim"] for o in out] == [384] * 3

    int8 = encode_sorted(encoder, texts)
    assert int8.shape == (len(texts), 384)
    assert torch.allclose(int8.norm(dim=1), torch.ones(len(texts)), atol=1e-5)
    cosines = torch.nn.functional.cosine_similarity(int8, before, dim=1)
    mean_bar, min_bar = BARS["7-bit" if needs_reduce_range() else "8-bit"]
    assert cosines.mean().item() >= mean_bar, cosines.tolist()
    assert cosines.min().item() >= min_bar, cosines.tolist()
    # Not a no-op: int8 kernels change the vectors measurably.
    assert cosines.mean().item() < 0.99999

    # fp32 is untouched by an int8 encoder in the same process (no global state was changed).
    assert torch.equal(encode_sorted(fp32, texts), before)
    plain = load_handler(kind="embedding", artifact=MINILM_URI, sha256=artifact_sha256(model_dir))
    assert isinstance(plain, EmbeddingHandler)
    assert plain.encoder.quantize is None
    # No option means fp32, with nothing measured (no calibration cost at start-up).
    assert plain.precision is not None
    assert (plain.precision.precision, plain.precision.speedup) == ("fp32", None)
    assert not any(isinstance(m, DynamicInt8Linear) for m in plain.encoder.model.modules())
    # The loader measures this host's pass cost, which may cut the texts into other passes (other
    # padding, other last bits): planned as the reference was, the vectors are the same.
    plain.encoder.pass_overhead_tokens = fp32.pass_overhead_tokens
    assert torch.equal(encode_sorted(plain.encoder, texts), before)


@pytest.mark.model
def test_int8_classifier_keeps_its_labels() -> None:
    _, held_out = split_examples(load_examples())
    head = resolve_artifact(INTENT_HEAD_URI)
    fp32 = load_handler(kind="classifier", artifact=INTENT_HEAD_URI, sha256=artifact_sha256(head))
    int8 = load_handler(kind="classifier", artifact=f"{INTENT_HEAD_URI}?quantize=int8", sha256=artifact_sha256(head),
                        precision=PrecisionPolicy(rounds=1))
    assert isinstance(int8, ClassifierHandler)
    assert int8.encoder.quantize == "int8"
    inputs = [{"text": ex.text} for ex in held_out]
    # Measured: 59 of the 60 held-out examples keep their fp32 label.
    same = sum(a["label"] == b["label"] for a, b in zip(fp32.run(inputs), int8.run(inputs), strict=True))
    assert same / len(inputs) >= 0.9


@pytest.mark.model
def test_auto_follows_the_measured_speedup_and_explicit_int8_runs_below_the_margin(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sha = artifact_sha256(model_dir)
    auto = f"{MINILM_URI}?quantize=auto"
    quick = PrecisionPolicy(rounds=1)
    chosen = load_handler(kind="embedding", artifact=auto, sha256=sha, precision=quick)
    assert isinstance(chosen, EmbeddingHandler) and chosen.precision is not None
    # What the rule says about what was measured here, and the encoder that actually runs.
    offered = candidates("auto", host_precisions("cpu"))
    assert set(chosen.precision.measured) == measured_precisions(offered)
    assert chosen.precision.precision in offered
    expected = {"int8": ("int8", torch.float32), "bf16": (None, torch.bfloat16), "fp32": (None, torch.float32)}
    assert (chosen.encoder.quantize, chosen.encoder.dtype) == expected[chosen.precision.precision]

    # A margin no host reaches: auto stays fp32, an explicit int8 runs int8 and says so.
    never = PrecisionPolicy(min_speedup=1000.0, rounds=1)
    fp32 = load_handler(kind="embedding", artifact=auto, sha256=sha, precision=never)
    assert isinstance(fp32, EmbeddingHandler) and fp32.precision is not None
    assert (fp32.precision.precision, fp32.encoder.quantize, fp32.encoder.dtype) == ("fp32", None, torch.float32)
    with caplog.at_level(logging.WARNING, logger="workers.models.calibration"):
        forced = load_handler(kind="embedding", artifact=INT8_URI, sha256=sha, precision=never)
    assert isinstance(forced, EmbeddingHandler) and forced.precision is not None
    assert (forced.precision.precision, forced.encoder.quantize, forced.precision.below_margin) == (
        "int8", "int8", True)
    assert any("does not pay" in record.getMessage() for record in caplog.records)


def test_int8_refuses_other_dtypes_and_modes(model_dir: Path) -> None:
    with pytest.raises(ModelError):
        MiniLMEncoder(model_dir=model_dir, quantize="int8", dtype=torch.bfloat16)
    with pytest.raises(ModelError):
        MiniLMEncoder(model_dir=model_dir, quantize="int4")


def test_int8_takes_7_bit_activations_when_asked() -> None:
    # What bench.quantized --emulate-no-vnni relies on, whatever this CPU needs by itself.
    cfg = BertConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                     max_position_embeddings=8, type_vocab_size=1, layer_norm_eps=1e-12, pad_token_id=0)
    for asked in (True, False):
        model = BertEncoder(cfg)
        quantize_int8(model, reduce_range=asked)
        assert {m.reduce_range for m in model.modules() if isinstance(m, DynamicInt8Linear)} == {asked}
    model = BertEncoder(cfg)
    quantize_int8(model)
    assert {m.reduce_range for m in model.modules() if isinstance(m, DynamicInt8Linear)} == {needs_reduce_range()}
