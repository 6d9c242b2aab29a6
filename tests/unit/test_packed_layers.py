"""bf16 MiniLM layers packed for oneDNN (workers/models/packed.py): the worker's bf16 encoder runs
them, and they answer what the plain bf16 layers answer, within bf16's rounding, on texts of every
length and in padded passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scheduler.planning.text_mix import skewed_texts
from sluice.artifacts import MINILM_URI, artifact_sha256, resolve_artifact
from sluice.errors import ModelError
from workers.models.bert import BertLayer
from workers.models.calibration import embedding_quality
from workers.models.loading import EmbeddingHandler, load_handler
from workers.models.minilm import MiniLMEncoder
from workers.models.packed import PackedBertLayer, PackedLinear, packs
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
    assert packed.packed and all(isinstance(layer, PackedBertLayer) for layer in packed.model.layers)
    assert not plain.packed and all(isinstance(layer, BertLayer) for layer in plain.model.layers)
    fp32 = MiniLMEncoder(model_dir=resolve_artifact(MINILM_URI))
    assert not fp32.packed and all(isinstance(layer, BertLayer) for layer in fp32.model.layers)
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


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("shape", [(5, 384), (3, 11, 384)])
def test_a_packed_linear_is_the_linear_with_its_weight_reordered(gelu: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 96).to(torch.bfloat16)
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        expected = linear(x).float()
        if gelu:
            expected = F.gelu(expected)
        got = PackedLinear(linear.weight, linear.bias, gelu=gelu)(x)
    assert got.shape == (*shape[:-1], 96) and got.dtype == torch.bfloat16
    # Both round to bf16 once at the end; the sums inside may differ in order.
    assert torch.allclose(got.float(), expected, atol=0.05, rtol=0.02)


def test_activation_maxima_are_refused_on_a_packed_encoder(packed: MiniLMEncoder) -> None:
    with pytest.raises(ModelError, match="unpacked"):
        packed.activation_maxima()
