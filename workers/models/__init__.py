"""Model runtime: MiniLM in plain torch, the model-kind handlers and artifact resolution.

This package's ``__init__`` and ``artifacts`` stay free of torch, so the control plane can
import ``workers.models.artifacts`` to record artifact hashes without loading it.
"""

from workers.models.artifacts import (
    INTENT_HEAD_URI,
    MINILM_URI,
    artifact_sha256,
    resolve_artifact,
)

__all__ = ["INTENT_HEAD_URI", "MINILM_URI", "artifact_sha256", "resolve_artifact"]
