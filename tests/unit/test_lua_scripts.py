"""The Lua scripts of the wire contract live in sluice/wire/lua/, one file each, and nowhere else:
every file says its KEYS and ARGV, every include resolves, every script compiles on a real server,
and no Python module carries Lua of its own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import redis

from sluice.references import INPUT_REF_FIELD, OUTPUT_REF_FIELD, WRITTEN_FIELD
from sluice.wire import events, scripts
from sluice.wire.outbox import OutboxEntry

REPO = Path(__file__).resolve().parents[2]
LUA = REPO / "sluice" / "wire" / "lua"
ALL_FILES = sorted(path.relative_to(LUA).as_posix() for path in LUA.rglob("*.lua"))
LIBRARY = [name for name in ALL_FILES if name.startswith("lib/")]


def _header(name: str) -> list[str]:
    """The comment lines a file opens with, before its first include or line of code."""
    lines = []
    for line in (LUA / name).read_text().splitlines():
        if not line.startswith("--") or line.startswith(scripts.INCLUDE):
            break
        lines.append(line)
    return lines


def _includes(name: str) -> list[str]:
    return [line[len(scripts.INCLUDE):].strip() for line in (LUA / name).read_text().splitlines()
            if line.startswith(scripts.INCLUDE)]


def test_the_loader_knows_every_script_file_and_the_library_is_all_it_includes() -> None:
    assert scripts.script_files() == [name for name in ALL_FILES if "/" not in name]
    assert LIBRARY and all(name.count("/") == 1 for name in LIBRARY)


@pytest.mark.parametrize("name", ALL_FILES)
def test_every_file_opens_with_its_keys_and_argv(name: str) -> None:
    header = _header(name)
    assert any(line.startswith("-- KEYS") for line in header), header
    assert any(line.startswith("-- ARGV") for line in header), header
    if "/" not in name:
        assert any(line.startswith("-- Returns:") for line in header), header


@pytest.mark.parametrize("name", ALL_FILES)
def test_every_include_resolves(name: str) -> None:
    for included in _includes(name):
        assert (LUA / included).is_file(), f"{name} includes {included}"
    text = scripts.load(name)
    assert scripts.INCLUDE not in text
    for included in _includes(name):
        assert (LUA / included).read_text() in text


def test_every_library_file_is_included_by_a_script() -> None:
    included = {lib for name in scripts.script_files() for lib in _includes(name)}
    assert included == set(LIBRARY)


def test_every_script_the_loader_knows_compiles_on_the_server(rds: redis.Redis) -> None:
    for name in scripts.script_files():
        source = scripts.load(name)
        # SCRIPT LOAD compiles the script: a syntax error fails here, not on the first job.
        assert rds.script_load(source) == hashlib.sha1(source.encode()).hexdigest(), name


def test_every_script_file_has_its_constant() -> None:
    constants = {value for name, value in vars(scripts).items()
                 if name.isupper() and isinstance(value, str) and name != "INCLUDE"}
    assert constants == {scripts.load(name) for name in scripts.script_files()}


def test_no_python_module_carries_an_inline_script() -> None:
    found = [f"{path.relative_to(REPO)}" for package in ("sluice", "api", "workers")
             for path in sorted((REPO / package).rglob("*.py"))
             if "redis.call" in path.read_text() or "redis.pcall" in path.read_text()]
    assert not found


def test_the_lua_twins_spell_what_the_python_codecs_read() -> None:
    job_type = json.loads(events.encode(events.JobChanged(id="job_x", status="running")))["type"]
    assert f"cjson.encode({{type='{job_type}', id=id, status=status}})" in scripts.load("lib/job_changed.lua")
    delivery_field, job_field = OutboxEntry(delivery_id="dlv_x", job_id="job_x").to_fields()
    assert f"'{delivery_field}', delivery, '{job_field}', id" in scripts.load("lib/queue_webhook.lua")
    assert f"'HMGET', job, '{INPUT_REF_FIELD}', '{OUTPUT_REF_FIELD}')" in scripts.load("claim.lua")
    assert f"'HSET', job, '{WRITTEN_FIELD}', written)" in scripts.load("finish.lua")


def test_a_missing_include_or_one_that_includes_itself_is_refused(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "broken.lua").write_text("--!include lib/absent.lua\nreturn 1\n")
    (tmp_path / "loop.lua").write_text("--!include lib/a.lua\nreturn 1\n")
    (tmp_path / "lib" / "a.lua").write_text("--!include loop.lua\n")
    monkeypatch.setattr(scripts, "_ROOT", tmp_path)
    with pytest.raises(scripts.ScriptError, match="lib/absent.lua"):
        scripts.load("broken.lua")
    with pytest.raises(scripts.ScriptError, match="loop.lua -> lib/a.lua -> loop.lua"):
        scripts.load("loop.lua")
