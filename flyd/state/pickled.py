"""Which payloads of a checkpoint envelope a restore would unpickle.

Why: the adapters (`workers.adapters.pettingzoo`, `gymnasium`) and any plugin may capture their
state with `pickle`, and restoring unpickles it, which runs whatever code the file's author put
there. A checkpoint the node wrote itself is safe; a file from elsewhere is not unless its source
is trusted. `flyctl checkpoints import` asks this module and refuses such a file without
`--trust` (docs/cli.md).

What counts: a plugin's bytes sit base64 in a payload's JSON as a `{digest, data}` blob
(`workers.state.plugin_blob`: an agent's `model`, the world's `world`, the task ledger's
`task`). A blob whose bytes start with the pickle `PROTO` opcode (0x80, protocol 2..5) and end
with `STOP` (`.`), which is every pickle `pickle.dumps` writes by default, is pickled; so is a
whole payload of that form. Protocol 0 and 1 pickles, which nothing in flyd writes, are not
recognised. Pure.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence
from typing import Any

import orjson

__all__ = ["is_pickle", "pickled_payloads"]

_PROTO: int = 0x80
_STOP: bytes = b"."


def is_pickle(data: bytes) -> bool:
    """Whether `data` is a pickle of protocol 2..5 (see the module docstring)."""
    return len(data) >= 3 and data[0] == _PROTO and 2 <= data[1] <= 5 and data.endswith(_STOP)


def _blobs(value: Any, path: str) -> Iterator[tuple[str, bytes]]:
    if isinstance(value, dict):
        if set(value) == {"digest", "data"} and isinstance(value["data"], str):
            try:
                yield path, base64.b64decode(value["data"], validate=True)
            except (binascii.Error, ValueError):
                return
            return
        for key, item in value.items():
            yield from _blobs(item, f"{path}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _blobs(item, f"{path}/{index}")


def pickled_payloads(payloads: Sequence[tuple[str, bytes]]) -> list[str]:
    """`<payload name><JSON Pointer>` of every pickled plugin blob (or `<name>` of a payload
    that is a pickle itself), in payload order."""
    found: list[str] = []
    for name, body in payloads:
        if is_pickle(body):
            found.append(name)
            continue
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            continue
        found.extend(f"{name}{path}" for path, data in _blobs(doc, "") if is_pickle(data))
    return found
