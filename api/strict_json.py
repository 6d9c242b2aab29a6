"""The JSON a request body may carry: what `json.loads` accepts, less what no part of Sluice can
store or send back (the rules of I-JSON, RFC 7493, and a little more).

Python's parser accepts text that other layers refuse later, each in its own way: a lone UTF-16
surrogate escape (`"\\ud800"`) decodes to a `str` that cannot be encoded as UTF-8 (the response,
the log, any store that takes UTF-8), `NaN`, `Infinity` and `1e999` cannot be written back as
JSON, U+0000 cannot be stored in a Postgres text column, an integer of more than 4300 digits
raises a plain ValueError, and deep nesting a RecursionError. Duplicate keys are read last-wins
here but first-wins by some proxies and clients, so two readers of one body could disagree about
it. `parse` refuses all of these in one pass, before any route sees the body.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

# Far above any body the API takes (an input is an object of scalars, metadata is flat), far below
# the parser's recursion limit.
MAX_DEPTH = 64

_SHOWN_KEY_CHARS = 40


class JsonRefused(ValueError):
    """The body is not JSON the API accepts; the message says where and why."""


def _refuse_constant(name: str) -> Any:
    raise JsonRefused(f"{name} is not a JSON number; numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonRefused(f"the number {text[:40]} is out of range; numbers must be finite")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonRefused(f"the key {_show(key)} appears twice in one object")
            seen.add(key)
    return value


def _show(key: str) -> str:
    """A key as it can be printed in an error message, whatever it holds."""
    shown = key if len(key) <= _SHOWN_KEY_CHARS else key[:_SHOWN_KEY_CHARS] + "..."
    return json.dumps(shown)


def _string_problem(text: str) -> str | None:
    if "\x00" in text:
        return "holds U+0000, which cannot be stored"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone UTF-16 surrogate, which is not a Unicode character"
    return None


def _where(path: tuple[str | int, ...]) -> str:
    parts = ["body"]
    for step in path:
        parts.append(f"[{step}]" if isinstance(step, int) else f".{_show(step)[1:-1]}")
    return "".join(parts)


def _strings(value: Any) -> Iterator[tuple[tuple[str | int, ...], str, bool]]:
    """Every string in the value, keys too, with where it is and whether it is a key. Iterative,
    so depth costs no stack; a container past MAX_DEPTH levels is refused on the way."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict | list) and len(path) >= MAX_DEPTH:
            raise JsonRefused(f"the body nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            for key, item in node.items():
                yield path, key, True
                stack.append(((*path, key), item))
        elif isinstance(node, list):
            stack.extend(((*path, index), item) for index, item in enumerate(node))
        elif isinstance(node, str):
            yield path, node, False


def parse(body: bytes) -> Any:
    """Parse a request body as `json.loads` would (UTF-8, or UTF-16/32 by its first bytes) and
    answer the value, or raise JsonRefused."""
    try:
        value = json.loads(
            body, parse_constant=_refuse_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except JsonRefused:
        raise
    except json.JSONDecodeError as exc:
        raise JsonRefused(f"the body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeDecodeError:
        raise JsonRefused("the body is not valid UTF-8") from None
    except RecursionError:
        raise JsonRefused(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        # The only other ValueError the parser raises: an integer past int's 4300-digit limit.
        raise JsonRefused("a number in the body has too many digits") from None
    for path, text, is_key in _strings(value):
        problem = _string_problem(text)
        if problem is not None:
            raise JsonRefused(f"{_where(path)}: {'a key' if is_key else 'the string'} {problem}")
    return value
