"""Model runtime: MiniLM parity with sentence-transformers, handlers, artifacts, heads."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.artifacts import (
    INTENT_HEAD_URI,
    MINILM_URI,
    artifact_sha256,
    manifest_text,
    parse_synthetic,
    resolve_artifact,
    text_sha256,
)
from sluice.errors import ArtifactError, ArtifactMismatch, InferenceError
from workers.models.head import write_degraded_head
from workers.models.int8 import DynamicInt8Linear, needs_reduce_range, smoothing_factors
from workers.models.loading import (
    ClassifierHandler,
    EmbeddingHandler,
    ModelHandler,
    SyntheticHandler,
    load_handler,
)
from workers.models.minilm import DEFAULT_MAX_BATCH_TOKENS, MiniLMEncoder, plan_passes
from workers.models.train_intent import load_examples, split_examples

pytestmark = pytest.mark.model

REPO_ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "hi",
    "",
    "Where is my order?",
    "I lost my credit card yesterday at the supermarket and I need to block it right now.",
    "The quick brown fox jumps over the lazy dog.",
    "Café Müller serves crème brûlée — naïve façade, déjà vu.",
    "东京是日本的首都",
    "emoji test 🚀🔥 with symbols #$%&*!",
    "Can you help me transfer 1,250.75 EUR to IBAN DE89 3704 0044 0532 0130 00?",
    "ok",
    "a " * 300,  # well past the 256-token limit: exercises truncation
    "Sentence transformers map sentences to a dense vector space. " * 12,
    "What time does the branch on 5th Avenue open on Saturdays?",
    "Refund   please,\tthe\nitem arrived broken",
    "UPPER CASE TEXT SHOULD BE LOWERCASED BY THE TOKENIZER",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "I'd like to speak with a human agent about my account's overdraft fees.",
    "Goodbye and thanks for all the fish",
    "1234567890 0987654321",
    "Reset my password, I forgot it again and the reset email never arrives in my inbox.",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_artifact(MINILM_URI)


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> MiniLMEncoder:
    return MiniLMEncoder(model_dir=model_dir)


@pytest.fixture(scope="module")
def head_path() -> Path:
    path = resolve_artifact(INTENT_HEAD_URI)
    return path


@pytest.fixture(scope="module")
def classifier(head_path: Path) -> ModelHandler:
    return load_handler(kind="classifier", artifact=INTENT_HEAD_URI, sha256=artifact_sha256(head_path))


@pytest.fixture(scope="module")
def held_out() -> list[tuple[str, str]]:
    _, held = split_examples(load_examples())
    return [(ex.text, ex.label) for ex in held]


# --- MiniLM encoder -------------------------------------------------------------------------


def test_matches_sentence_transformers(encoder: MiniLMEncoder, model_dir: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(model_dir), device="cpu")
    expected = torch.as_tensor(reference.encode(TEXTS, batch_size=8, convert_to_numpy=True))
    got = encoder.encode(TEXTS)
    assert got.shape == (len(TEXTS), 384)
    cosines = torch.nn.functional.cosine_similarity(got, expected, dim=1)
    assert cosines.min().item() >= 0.9999, cosines.tolist()


def test_unit_norm_and_truncation(encoder: MiniLMEncoder) -> None:
    vectors = encoder.encode(TEXTS)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    lengths = encoder.token_lengths(TEXTS)
    assert lengths[TEXTS.index("hi")] == 3  # [CLS] hi [SEP]
    assert lengths[TEXTS.index("")] == 2
    assert max(lengths) == 256
    assert encoder.encode([]).shape == (0, 384)


@pytest.mark.parametrize("max_batch_tokens", [1 << 30, DEFAULT_MAX_BATCH_TOKENS, 1])
def test_padding_and_passes_do_not_change_vectors(encoder: MiniLMEncoder, max_batch_tokens: int) -> None:
    # 1 << 30: the whole batch in one padded pass; 1: every text alone, in input order or not.
    encoder.max_batch_tokens = max_batch_tokens
    try:
        batch = encoder.encode(TEXTS)
    finally:
        encoder.max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
    for i in range(len(TEXTS)):
        alone = encoder.encode([TEXTS[i]])[0]
        assert torch.nn.functional.cosine_similarity(batch[i], alone, dim=0) >= 0.99999
        assert torch.allclose(batch[i], alone, atol=1e-5)


def _pass_cost(lengths: list[int], passes: list[list[int]], overhead: int) -> int:
    return sum(overhead + len(p) * max(lengths[i] for i in p) for p in passes)


@pytest.mark.parametrize("seed", range(60))
def test_plan_passes_is_the_cheapest_split(seed: int) -> None:
    rng = random.Random(seed)
    # Every third seed draws from few lengths, so runs of equal lengths meet caps that bind and
    # caps that cannot (the GPU's, where only cuts between distinct lengths are tried).
    if seed % 3:
        lengths = [rng.choice([rng.randint(3, 40), rng.randint(100, 256)]) for _ in range(rng.randint(1, 9))]
    else:
        lengths = [rng.choice([7, 7, 12, 30, 120]) for _ in range(rng.randint(1, 11))]
    cap, overhead = rng.choice([64, 512, 4096, 65536]), rng.choice([0, 24, 200, 1024])
    passes = plan_passes(lengths, max_batch_tokens=cap, overhead_tokens=overhead)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    assert all(len(p) == 1 or len(p) * max(lengths[i] for i in p) <= cap for p in passes)
    # Brute force: every way to cut the length-sorted order into runs that respect the cap.
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cheapest = None
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        runs, run = [], [order[0]]
        for index, cut in zip(order[1:], cuts, strict=True):
            if cut:
                runs.append(run)
                run = []
            run.append(index)
        runs.append(run)
        if all(len(r) == 1 or len(r) * max(lengths[i] for i in r) <= cap for r in runs):
            cost = _pass_cost(lengths, runs, overhead)
            cheapest = cost if cheapest is None else min(cheapest, cost)
    assert _pass_cost(lengths, passes, overhead) == cheapest


def test_plan_passes_keeps_long_texts_away_from_short_ones() -> None:
    lengths = [20, 18, 200, 22, 19, 21, 17, 23, 190]
    passes = plan_passes(lengths, max_batch_tokens=2048, overhead_tokens=24)
    assert passes == [[6, 1, 4, 0, 5, 3, 7], [8, 2]]
    assert plan_passes([], max_batch_tokens=2048, overhead_tokens=24) == []
    # A text longer than the cap still runs, alone.
    assert plan_passes([5000, 3], max_batch_tokens=2048, overhead_tokens=24) == [[1], [0]]


def test_encoder_is_dynamically_quantizable(encoder: MiniLMEncoder, model_dir: Path) -> None:
    quantized = MiniLMEncoder(model_dir=model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated but still works
        quantized.model = torch.ao.quantization.quantize_dynamic(  # type: ignore[no-untyped-call]
            quantized.model, {torch.nn.Linear}, dtype=torch.qint8
        )
    assert "DynamicQuantizedLinear" in repr(quantized.model)
    cosines = torch.nn.functional.cosine_similarity(quantized.encode(TEXTS[:6]), encoder.encode(TEXTS[:6]), dim=1)
    # Only compatibility is checked here: torch's default x86 dynamic qconfig (per-tensor,
    # reduce_range) measured cosine 0.87-0.95 against fp32 on these texts.
    assert cosines.min().item() > 0.8


def test_int8_linear_smoothing_and_first_token_scale() -> None:
    # What the int8 encoder relies on: smoothing leaves x @ W.T unchanged up to int8 rounding and
    # tames an outlier channel; [CLS]'s own scale keeps one large first token from coarsening
    # every other token's.
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(3, 10, 64)
    x[..., 5] *= 30.0  # an outlier channel
    x[:, 0] *= 8.0  # a large first token
    with torch.no_grad():
        exact = linear(x)

        # 7-bit activations where this CPU's kernel could overflow 8-bit ones (no AVX512-VNNI), as
        # the encoder asks: with 8 bits there, the saturated sums swamp what is measured here.
        reduce_range = needs_reduce_range()

        def error(**options: Any) -> float:
            out = DynamicInt8Linear(linear, reduce_range=reduce_range, **options)(x)
            return float((out - exact).norm() / exact.norm())

        plain = error()
        smoothing = smoothing_factors(x.abs().amax(dim=(0, 1)), linear.weight)
        smoothed = error(smoothing=smoothing)
        both = error(smoothing=smoothing, first_token_scale=True)
        single = DynamicInt8Linear(linear, reduce_range=reduce_range, smoothing=smoothing, first_token_scale=True)
        assert single(x[:, :1]).shape == (3, 1, 48)  # one token: nothing to split
        assert single(x[0]).shape == (10, 48)  # 2-D input: one scale, as the kernel gives it
    assert both < smoothed < plain, (plain, smoothed, both)
    assert both < 0.02


def test_missing_model_dir_is_artifact_error(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError):
        MiniLMEncoder(model_dir=tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ArtifactError):
        MiniLMEncoder(model_dir=tmp_path)


# --- handlers -------------------------------------------------------------------------------


def test_embedding_handler(model_dir: Path) -> None:
    handler = load_handler(kind="embedding", artifact=MINILM_URI, sha256=artifact_sha256(model_dir))
    assert isinstance(handler, EmbeddingHandler)
    assert isinstance(handler, ModelHandler)
    handler.warmup()
    out = handler.run([{"text": "hello"}, {"text": "where is my parcel"}])
    assert [o["dim"] for o in out] == [384, 384]
    assert len(out[0]["embedding"]) == 384
    assert all(isinstance(x, float) for x in out[0]["embedding"])
    with pytest.raises(InferenceError):
        handler.run([{"text": "fine"}, {"text": "__poison__"}])
    with pytest.raises(InferenceError):
        handler.run([{"text": 3}])
    assert handler.run([]) == []


def test_classifier_held_out_accuracy(classifier: ModelHandler, held_out: list[tuple[str, str]]) -> None:
    assert isinstance(classifier, ClassifierHandler)
    out = classifier.run([{"text": text} for text, _ in held_out])
    correct = sum(o["label"] == label for o, (_, label) in zip(out, held_out, strict=True))
    assert correct / len(held_out) >= 0.8
    first = out[0]
    assert set(first["scores"]) == set(classifier.labels)
    assert sum(first["scores"].values()) == pytest.approx(1.0, abs=1e-4)
    assert first["label"] == max(first["scores"], key=first["scores"].__getitem__)
    with pytest.raises(InferenceError):
        classifier.run([{"text": "__poison__"}])


def test_degraded_head_is_confidently_wrong(
    tmp_path: Path,
    head_path: Path,
    classifier: ModelHandler,
    held_out: list[tuple[str, str]],
) -> None:
    degraded_path = tmp_path / "degraded.safetensors"
    write_degraded_head(head_path, degraded_path, seed=7)
    degraded = load_handler(kind="classifier", artifact=str(degraded_path), sha256=artifact_sha256(degraded_path))
    inputs = [{"text": text} for text, _ in held_out]
    good, bad = classifier.run(inputs), degraded.run(inputs)
    disagree = sum(g["label"] != b["label"] for g, b in zip(good, bad, strict=True))
    assert disagree / len(inputs) >= 0.8
    wrong = sum(b["label"] != label for b, (_, label) in zip(bad, held_out, strict=True))
    assert wrong / len(inputs) >= 0.8
    confidence = sum(max(b["scores"].values()) for b in bad) / len(bad)
    assert confidence >= 0.7


def test_synthetic_handler_cost_echo_and_poison() -> None:
    handler = SyntheticHandler(fixed_s=0.01, per_item_s=0.001, per_token_s=0.0001)
    assert handler.kind == "synthetic"
    inputs: list[dict[str, Any]] = [{"tokens": 100}, {"text": "three word text"}]
    # padding semantics: both items are charged as the longest (100 tokens)
    assert handler.cost_s(inputs) == pytest.approx(0.01 + 0.002 + 0.0001 * 100 * 2)
    start = time.perf_counter()
    out = handler.run(inputs)
    assert time.perf_counter() - start >= 0.03
    assert out == [{"echo": {"tokens": 100}}, {"echo": {"text": "three word text"}}]
    with pytest.raises(InferenceError):
        handler.run([{"text": "ok"}, {"text": "__poison__"}, {"text": "ok"}])
    with pytest.raises(InferenceError):
        handler.run([{"tokens": -1}])
    with pytest.raises(InferenceError):
        handler.run([{"nothing": True}])
    assert handler.run([]) == []


def test_load_synthetic_from_uri() -> None:
    handler = load_handler(kind="synthetic", artifact="synthetic:?fixed_s=0.001&per_token_s=0.00001", sha256=None)
    assert isinstance(handler, SyntheticHandler)
    assert handler.fixed_s == 0.001
    assert handler.per_token_s == 0.00001
    assert handler.per_item_s == 0.0005  # default kept
    assert parse_synthetic("synthetic:") == {}
    with pytest.raises(ArtifactError):
        parse_synthetic("synthetic:?bogus=1")
    with pytest.raises(ArtifactError):
        parse_synthetic("synthetic:?fixed_s=-1")


def test_synthetic_path_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from workers.models.loading import load_handler\n"
        "from sluice.artifacts import artifact_sha256, resolve_artifact\n"
        "h = load_handler(kind='synthetic', artifact='synthetic:?fixed_s=0', sha256='')\n"
        "h.run([{'tokens': 3}])\n"
        "artifact_sha256(resolve_artifact('pkg:workers.models/intent_head.safetensors'))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=60)


# --- artifacts ------------------------------------------------------------------------------


def test_sha256_mismatch_raises(head_path: Path, model_dir: Path) -> None:
    wrong = "0" * 64
    with pytest.raises(ArtifactMismatch) as info:
        load_handler(kind="classifier", artifact=INTENT_HEAD_URI, sha256=wrong)
    message = str(info.value)
    assert wrong in message and artifact_sha256(head_path) in message
    assert str(head_path) in message
    with pytest.raises(ArtifactMismatch):
        load_handler(kind="embedding", artifact=MINILM_URI, sha256=wrong)


def test_missing_or_unhashed_artifacts(tmp_path: Path, head_path: Path) -> None:
    with pytest.raises(ArtifactError):
        load_handler(kind="classifier", artifact=str(tmp_path / "missing.safetensors"), sha256="0")
    with pytest.raises(ArtifactError):
        load_handler(kind="classifier", artifact="pkg:workers.models/missing.bin", sha256="0")
    with pytest.raises(ArtifactError):  # only synthetic artifacts may skip the hash
        load_handler(kind="classifier", artifact=INTENT_HEAD_URI, sha256=None)
    bogus = tmp_path / "bogus.safetensors"
    bogus.write_bytes(b"not a safetensors file")
    with pytest.raises(ArtifactError):
        load_handler(kind="classifier", artifact=str(bogus), sha256=artifact_sha256(bogus))


def test_resolve_artifact_forms(tmp_path: Path, model_dir: Path, head_path: Path) -> None:
    assert model_dir.is_dir() and (model_dir / "model.safetensors").is_file()
    assert head_path.name == "intent_head.safetensors" and head_path.is_file()
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    assert resolve_artifact(f"file://{f}") == f
    assert resolve_artifact(str(f)) == f
    assert artifact_sha256(f) == ("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    # A directory's sha256 covers every file in it (its manifest), not the weights alone.
    assert artifact_sha256(model_dir) == text_sha256(manifest_text(model_dir)) != artifact_sha256(
        model_dir / "model.safetensors")
    with pytest.raises(ArtifactError):
        resolve_artifact("synthetic:?fixed_s=1")
    with pytest.raises(ArtifactError):
        resolve_artifact("file://remotehost/etc/passwd")
