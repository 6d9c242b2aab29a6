"""A version's worker Deployment name: one per exact (model, version), the same on every start, and a
valid DNS-1123 label whatever the registry allows in the names."""

from __future__ import annotations

import hashlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.kubernetes import DEFAULT_TEMPLATE, deployment_name

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# What the registry accepts as a model or version name.
REGISTRY_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,120}", fullmatch=True)


def _name(model: str, version: str) -> str:
    return deployment_name(DEFAULT_TEMPLATE, model, version)


@pytest.mark.parametrize("one,other", [
    (("minilm", "v2-int8"), ("minilm-v2", "int8")),  # where the separator falls
    (("Minilm", "v1"), ("minilm", "v1")),  # case
    (("intent", "v1.2"), ("intent", "v1-2")),  # punctuation the label cannot hold
    (("intent", "v1_2"), ("intent", "v1.2")),
    (("a" * 80 + "x", "v1"), ("a" * 80 + "y", "v1")),  # the same once truncated
])
def test_versions_that_read_alike_get_distinct_names(one: tuple[str, str], other: tuple[str, str]) -> None:
    assert _name(*one) != _name(*other)


def test_the_name_is_a_readable_prefix_and_the_sha256_of_the_exact_names() -> None:
    digest = hashlib.sha256(b"minilm/v1").hexdigest()[:10]
    assert _name("minilm", "v1") == f"sluice-worker-minilm-v1-{digest}"
    assert _name("Intent_Model", "v1.2").startswith("sluice-worker-intent-model-v1-2-")


@given(model=REGISTRY_NAME, version=REGISTRY_NAME)
def test_every_name_is_a_dns_label_of_at_most_63_characters(model: str, version: str) -> None:
    name = _name(model, version)
    assert DNS_LABEL.fullmatch(name), name
    assert name == _name(model, version)


def test_a_template_that_leaves_no_readable_part_still_names_a_label() -> None:
    name = deployment_name("{model}{version}", "_", "_")
    assert DNS_LABEL.fullmatch(name), name
