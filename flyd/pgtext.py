"""What PostgreSQL `text` and `jsonb` can hold, checked before anything is stored.

Why: both refuse U+0000 and any string that is not valid UTF-8, such as a lone surrogate from
a `\\ud800` escape in JSON or from undecodable bytes in argv or the environment. A config or
run-spec string holding one used to pass validation and fail later inside PostgreSQL with a
traceback. Every config value and every spec string (keys too) is checked here first, and
the refusal names the key or JSON Pointer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["bad_strings", "text_problem"]


def text_problem(value: str) -> str | None:
    """Why `value` cannot be stored as PostgreSQL text, or None."""
    nul = value.find("\x00")
    if nul >= 0:
        return f"contains a NUL character (U+0000) at offset {nul}, which PostgreSQL text " \
               "cannot hold"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains {value[exc.start]!r} at offset {exc.start}, which is not UTF-8 text "
                "(a lone surrogate or undecodable byte)")
    return None


def _pointer(path: str, key: str | int) -> str:
    text = str(key)
    return f"{path}/{text.replace('~', '~0').replace('/', '~1')}"


def bad_strings(doc: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """`(JSON Pointer, problem)` of every string in `doc` (object keys included) that
    `text_problem` refuses, depth first, in document order. A refused key is named (escaped)
    in the problem, at its object's pointer, so the pointer itself is always storable text."""
    stack: list[tuple[str, Any]] = [(path, doc)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            problem = text_problem(value)
            if problem is not None:
                yield where, problem
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):
                if isinstance(key, str):
                    problem = text_problem(key)
                    if problem is not None:
                        yield where, f"key {key!r} {problem}"
                        continue
                stack.append((_pointer(where, key), item))
        elif isinstance(value, list):
            stack.extend((_pointer(where, i), item) for i, item in reversed(list(enumerate(value))))
