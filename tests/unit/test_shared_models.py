"""Weights loaded once per process (workers/models/shared.py), on the bundled MiniLM: clones share
one handler, the classifier head shares the embedding model's encoder, an int8 variant has its
own, the integrity check still runs per artifact, and the last release lets the model go."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sluice.artifacts import MINILM_PACKAGE, artifact_sha256, resolve_artifact
from sluice.errors import ArtifactMismatch
from workers.models.loading import Sources
from workers.models.precision import PrecisionPolicy
from workers.models.shared import Loaded, LoadedModels

pytestmark = pytest.mark.model

MINILM = f"pkg:{MINILM_PACKAGE}"
HEAD = "pkg:workers.models/intent_head.safetensors"


def acquire(models: LoadedModels, kind: str, artifact: str, sha256: str | None = None) -> Loaded:
    declared = sha256 or artifact_sha256(resolve_artifact(artifact.split("?")[0]))
    return models.acquire(kind=kind, artifact=artifact, sha256=declared, device="cpu", threads=1,
                          precision=PrecisionPolicy(rounds=1), sources=Sources())


def test_clones_share_one_handler_and_the_head_shares_the_encoder() -> None:
    models = LoadedModels()
    first = acquire(models, "embedding", MINILM)
    clone = acquire(models, "embedding", MINILM)
    assert clone.handler is first.handler and clone.shared and clone.resident_bytes == 0
    head = acquire(models, "classifier", HEAD)
    assert head.handler.encoder is first.handler.encoder  # type: ignore[attr-defined]
    assert head.resident_bytes < 30 * 2**20, head.resident_bytes
    assert models.holders(first) == 2


def test_the_first_load_in_a_fresh_process_reports_what_it_grew_the_process_by() -> None:
    # In a fresh process: in this one, earlier tests' freed models leave heap pages a load reuses.
    script = ("from tests.unit.test_shared_models import MINILM, acquire;"
              "from workers.models.shared import LoadedModels;"
              "print(acquire(LoadedModels(), 'embedding', MINILM).resident_bytes)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert int(done.stdout.split()[-1]) > 20 * 2**20, done.stdout


def test_a_wrong_sha256_is_refused_even_with_the_file_already_loaded() -> None:
    models = LoadedModels()
    acquire(models, "embedding", MINILM)
    with pytest.raises(ArtifactMismatch):
        acquire(models, "embedding", MINILM, sha256="0" * 64)


def test_an_int8_variant_has_its_own_encoder_and_the_last_release_drops_a_model() -> None:
    models = LoadedModels()
    fp32 = acquire(models, "embedding", MINILM)
    int8 = acquire(models, "embedding", f"{MINILM}?quantize=int8")
    assert int8.handler is not fp32.handler
    assert int8.handler.encoder is not fp32.handler.encoder  # type: ignore[attr-defined]
    clone = acquire(models, "embedding", MINILM)
    models.release(fp32)
    assert models.holders(clone) == 1
    models.release(clone)
    assert models.holders(clone) == 0
    again = acquire(models, "embedding", MINILM)
    assert again.handler is not fp32.handler and not again.shared
