"""bf16 layers packed for oneDNN (workers/models/packed.py): the worker's bf16 MiniLM and Hugging
Face models run them, and they answer what the plain bf16 layers answer, within bf16's rounding,
on texts of every length and in padded passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from scheduler.planning.text_mix import skewed_texts
from sluice.artifacts import MINILM_URI, artifact_sha256, resolve_artifact
from sluice.errors import ModelError
from tests.hf_models import build_tiny_classifier
from workers.models.bert import LINEAR_NAMES, BertLayer
from workers.models.calibration import QUALITY_TEXTS, embedding_quality
from workers.models.hf import HfClassifierHandler, HfEmbeddingHandler
from workers.models.loading import EmbeddingHandler, load_handler
from workers.models.minilm import MiniLMEncoder
from workers.models.packed import PackedLinear, pack_linears, packs
from workers.models.precision import PrecisionPolicy, QualityBound

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not packs(torch.device("cpu"), torch.bfloat16),
                       reason="this CPU's oneDNN runs no bf16, so nothing is packed"),
]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return skewed_texts(48, seed=5)


@pytest.fixture(scope="module")
def plain() -> MiniLMEncoder:
    return MiniLMEncoder(model_dir=resolve_artifact(MINILM_URI), dtype=torch.bfloat16, packed=False)


@pytest.fixture(scope="module")
def packed() -> MiniLMEncoder:
    return MiniLMEncoder(model_dir=resolve_artifact(MINILM_URI), dtype=torch.bfloat16)


def test_a_bf16_cpu_encoder_is_packed_unless_asked_not_to_and_fp32_never_is(
    plain: MiniLMEncoder, packed: MiniLMEncoder,
) -> None:
    for layer in packed.model.layers:
        assert isinstance(layer, BertLayer) and isinstance(layer.ffn_in, PackedLinear)
        assert all(isinstance(getattr(layer, name), PackedLinear) for name in LINEAR_NAMES)
        assert isinstance(layer.ffn_act, torch.nn.Identity)  # the GELU runs inside ffn_in
    assert packed.packed and not plain.packed
    fp32 = MiniLMEncoder(model_dir=resolve_artifact(MINILM_URI))
    for encoder in (plain, fp32):
        assert not any(isinstance(module, PackedLinear) for module in encoder.model.modules())
    assert not packs(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("batch_size", [1, 7, 32])
def test_packed_layers_answer_what_the_plain_bf16_layers_answer(
    plain: MiniLMEncoder, packed: MiniLMEncoder, texts: list[str], batch_size: int,
) -> None:
    # Batches of mixed lengths: padded passes, so the attention mask is exercised too.
    ours = torch.cat([packed.encode(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)])
    theirs = torch.cat([plain.encode(texts[i:i + batch_size]) for i in range(0, len(texts), batch_size)])
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    cosines = F.cosine_similarity(ours, theirs, dim=1)
    assert cosines.min().item() >= 0.9995, cosines.min().item()


def test_the_worker_loads_bf16_packed_and_within_the_quality_bound(texts: list[str]) -> None:
    handler = load_handler(kind="embedding", artifact=f"{MINILM_URI}?precision=bf16",
                           sha256=artifact_sha256(resolve_artifact(MINILM_URI)), precision=PrecisionPolicy(rounds=1))
    assert isinstance(handler, EmbeddingHandler) and handler.encoder.packed
    fp32 = MiniLMEncoder(model_dir=resolve_artifact(MINILM_URI))
    assert embedding_quality(fp32.encode(texts), handler.encoder.encode(texts)).within(QualityBound())


@pytest.mark.parametrize("exact_rows", [False, True])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("shape", [(5, 384), (3, 11, 384), (16, 384), (7, 89, 384)])
def test_a_packed_linear_is_the_linear_with_its_weight_reordered(gelu: bool, shape: tuple[int, ...],
                                                                 exact_rows: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 96).to(torch.bfloat16)
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x).float()
        if gelu:
            expected = F.gelu(expected)
        got = PackedLinear(linear.weight, linear.bias, gelu=gelu, exact_rows=exact_rows)(x)
    assert got.shape == (*shape[:-1], 96) and got.dtype == torch.bfloat16
    # Both round to bf16 once at the end; the sums inside may differ in order.
    assert torch.allclose(got.float(), expected, atol=0.05, rtol=0.02)


def test_activation_maxima_are_refused_on_a_packed_encoder(packed: MiniLMEncoder) -> None:
    with pytest.raises(ModelError, match="unpacked"):
        packed.activation_maxima()


def test_a_hugging_face_classifier_in_bf16_runs_packed_projections_with_the_same_probabilities(
    tmp_path: Path,
) -> None:
    directory = build_tiny_classifier(tmp_path / "clf")
    handler = load_handler(kind="hf-classifier", artifact=f"file://{directory}?precision=bf16",
                           sha256=artifact_sha256(directory), precision=PrecisionPolicy(rounds=1))
    assert isinstance(handler, HfClassifierHandler)
    linears = [m for m in handler.model.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    plain = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    texts = list(QUALITY_TEXTS[:6])
    with torch.inference_mode():
        batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        expected = plain(**batch).logits.float().softmax(dim=-1)
    got = handler.probabilities(texts)
    assert torch.allclose(got, expected, atol=0.01), (got - expected).abs().max().item()


def test_hf_embedding_in_bf16_is_packed_and_within_the_bound(texts: list[str]) -> None:
    model_dir = resolve_artifact(MINILM_URI)
    handler = load_handler(kind="hf-embedding", artifact=f"file://{model_dir}?precision=bf16",
                           sha256=artifact_sha256(model_dir), precision=PrecisionPolicy(rounds=1))
    assert isinstance(handler, HfEmbeddingHandler)
    assert any(isinstance(m, PackedLinear) for m in handler.model.modules())
    fp32 = MiniLMEncoder(model_dir=model_dir)
    assert embedding_quality(fp32.encode(texts[:16]), handler.vectors(texts[:16])).within(QualityBound())


def test_pack_linears_swaps_only_bf16_linears() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(8, 4).to(torch.bfloat16)), torch.nn.Linear(4, 2))
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert type(model[3]) is torch.nn.Linear
    assert model[0].weight.dtype == torch.bfloat16 and tuple(model[0].weight.shape) == (8, 8)
