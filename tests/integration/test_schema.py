"""The migrations and the ORM describe the same schema: a migrated database differs from
`sluice.registry.tables` in nothing Alembic can compare (columns, types, defaults, constraints)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text

from sluice.artifacts import DIR_WEIGHTS_FILE, MINILM_URI, artifact_sha256, file_sha256, resolve_artifact
from sluice.migrate import downgrade, upgrade
from sluice.registry.tables import Base
from tests.support import fresh_database, normalise_url


def test_the_migrated_schema_is_the_orm_s(database_url: str) -> None:
    engine = create_engine(normalise_url(database_url))
    try:
        with engine.connect() as conn:
            differences = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert differences == []


def test_0005_gives_a_directory_version_hashed_by_its_weights_the_hash_of_every_file(database_url: str) -> None:
    """Before 0005 a directory's sha256 was its model.safetensors'; a version whose weights still
    match gets the manifest's hash (so it keeps loading, every file verified), others keep theirs."""
    minilm = resolve_artifact(MINILM_URI)
    legacy = file_sha256(minilm / DIR_WEIGHTS_FILE)
    with fresh_database("schema", "0004") as url:
        engine = create_engine(normalise_url(url))
        try:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO models (name, kind) VALUES ('m', 'embedding')"))
                for version, sha256 in (("v1", legacy), ("v2", "0" * 64)):
                    conn.execute(text("INSERT INTO model_versions (model, version, artifact, sha256, state, "
                                      "max_batch_size, max_wait_ms, isolate_tenants, min_replicas, max_replicas, "
                                      "latency_budget_ms) VALUES ('m', :v, :a, :s, 'stable', 8, 5, true, 1, 2, 2000)"),
                                 {"v": version, "a": MINILM_URI, "s": sha256})
            upgrade(url)
            with engine.connect() as conn:
                hashes = dict(conn.execute(text("SELECT version, sha256 FROM model_versions")).all())
            assert hashes == {"v1": artifact_sha256(minilm), "v2": "0" * 64}
            downgrade(url, "0004")
            upgrade(url)
        finally:
            engine.dispose()

