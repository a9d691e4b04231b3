"""Reader checks R1–R8, each on its own first defect (state.md §2.6, §10 tests 7–16).

Every case asserts `EnvelopeError.check`, `INCOMPATIBLE_STATE` and `none`. Edits after R2 are
resealed (fileBytes and the footer digest rewritten) so the later checks are reachable. Files
whose layout itself is wrong are written by `raw_pack`, a layout writer of this test module that
checks nothing, independent of the encoder under test.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from flyd.state.envelope import (
    MANIFEST_FIELDS,
    MAX_PAYLOADS,
    EnvelopeError,
    align8,
    decode,
    encode,
    pack,
)
from workers.types.canonical import canonical, digest_bytes
from workers.types.domain import ErrorCode, Mutation

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "checkpoint-envelope.json"
DOC: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
DATA = base64.b64decode(DOC["envelope"], validate=True)
MANIFEST: dict[str, Any] = DOC["manifest"]
PAYLOADS = [(p["name"], p["utf8"].encode("utf-8")) for p in DOC["payloads"]]
M = DOC["layout"]["header"]["manifestBytes"]
T = DOC["layout"]["header"]["tableOffset"]
F = DOC["layout"]["footerOffset"]
ENTRIES = DOC["layout"]["entries"]


def reseal(data: bytes | bytearray) -> bytes:
    out = bytearray(data)
    f = len(out) - 48
    struct.pack_into("<Q32s", out, f, len(out), hashlib.sha256(out[:f]).digest())
    return bytes(out)


def patch(data: bytes, at: int, new: bytes, *, sealed: bool = True) -> bytes:
    out = bytearray(data)
    out[at:at + len(new)] = new
    return reseal(out) if sealed else bytes(out)


def raw_pack(manifest_bytes: bytes, payloads: list[tuple[str, bytes]], *,
             count: int | None = None, tail: int = 0) -> bytes:
    """The §2.2 layout with no checks; `tail` extra zero bytes before the footer."""
    m = len(manifest_bytes)
    t = align8(32 + m)
    end = t + 112 * len(payloads)
    table, body = bytearray(), bytearray()
    for name, data in payloads:
        offset = align8(end)
        body += bytes(offset - end) + data
        table += struct.pack("<64sQQ32s", name.encode("utf-8"), offset, len(data),
                             hashlib.sha256(data).digest())
        end = offset + len(data)
    f = align8(end) + tail
    n = len(payloads) if count is None else count
    out = bytearray(struct.pack("<8sIIIIII", b"FLYSESS1", 1, 32, m, n, t, 0))
    out += manifest_bytes + bytes(t - 32 - m) + table + body
    out += bytes(f - len(out))
    out += struct.pack("<Q32s8s", f + 48, hashlib.sha256(out).digest(), b"FLYSESSF")
    return bytes(out)


def listing(payloads: list[tuple[str, bytes]]) -> list[dict[str, str]]:
    return [{"name": n, "byteLength": str(len(b)), "digest": digest_bytes(b)} for n, b in payloads]


def with_manifest(edit: Any, payloads: list[tuple[str, bytes]] | None = None) -> bytes:
    """A well-laid-out file whose manifest `edit` changed (encode would refuse it)."""
    manifest = copy.deepcopy(MANIFEST)
    edit(manifest)
    return pack(canonical(manifest), PAYLOADS if payloads is None else payloads)


def refused(data: bytes, check: str, *words: str) -> EnvelopeError:
    with pytest.raises(EnvelopeError) as caught:
        decode(data)
    error = caught.value
    assert error.check == check, error.message
    assert error.code == ErrorCode.INCOMPATIBLE_STATE and error.mutation == Mutation.NONE
    assert error.message.startswith(f"envelope {check}: ")
    for word in words:
        assert word in error.message, error.message
    return error


def test_the_fixture_is_sound() -> None:
    assert decode(DATA).manifest == MANIFEST
    assert raw_pack(canonical(MANIFEST), PAYLOADS) == DATA  # the test writer agrees


def test_r1_header() -> None:
    refused(DATA[:79], "R1", "79 bytes")
    refused(patch(DATA, 0, b"OTHERFMT"), "R1", "OTHERFMT")
    refused(patch(DATA, 8, struct.pack("<I", 2)), "R1", "envelopeVersion 2")
    refused(patch(DATA, 12, struct.pack("<I", 31)), "R1", "headerBytes 31")
    refused(patch(DATA, 28, struct.pack("<I", 1)), "R1", "reserved")
    refused(patch(DATA, 20, struct.pack("<I", MAX_PAYLOADS + 1)), "R1", "payloadCount 1025")


def test_r2_footer() -> None:
    refused(patch(DATA, F + 40, b"FLYSESSX", sealed=False), "R2", "footer magic")
    refused(patch(DATA, F, struct.pack("<Q", len(DATA) + 8), sealed=False), "R2", "fileBytes")
    refused(DATA[:-8], "R2")
    first = ENTRIES[0]["offset"]
    refused(patch(DATA, first, bytes([DATA[first] ^ 1]), sealed=False), "R2", "SHA-256")


def test_r3_manifest() -> None:
    refused(patch(DATA, 16, struct.pack("<I", F)), "R3", "past the footer")
    refused(patch(DATA, 34, b"\xff"), "R3", "UTF-8")
    text = canonical(MANIFEST)
    duplicate = b'{"agents":[],' + text[1:]
    refused(raw_pack(duplicate, PAYLOADS), "R3", "duplicate key")
    refused(raw_pack(text[:-1] + b',"x":NaN}', PAYLOADS), "R3", "NaN")
    refused(raw_pack(text.replace(b":", b": ", 1), PAYLOADS), "R3", "canonical")


def test_r4_table() -> None:
    refused(patch(DATA, 24, struct.pack("<I", T + 8)), "R4", f"tableOffset {T + 8}")
    assert 32 + M < T
    refused(patch(DATA, 32 + M, b"\x01"), "R4", "padding")
    small = raw_pack(canonical({}), [("a", b"x")])
    refused(patch(small, 20, struct.pack("<I", 64)), "R4", "past the footer")


def test_r5_entries() -> None:
    table = T
    refused(patch(DATA, table, b"W"), "R5", "'World'")
    refused(patch(DATA, table + 5, b"\0X"), "R5", "NUL")
    refused(patch(DATA, table + 64, struct.pack("<Q", ENTRIES[0]["offset"] + 8)), "R5",
            "offset")
    last = table + 112 * 5
    refused(patch(DATA, last + 72, struct.pack("<Q", F)), "R5", "past the footer")
    first = ENTRIES[0]["offset"]
    refused(patch(DATA, first, bytes([DATA[first] ^ 1])), "R5", "SHA-256")
    refused(patch(DATA, table + 112, b"world".ljust(64, b"\0")), "R5", "twice")


def test_r6_tail() -> None:
    refused(raw_pack(canonical(MANIFEST), PAYLOADS, tail=8), "R6", "footer")
    last = ENTRIES[-1]
    end = last["offset"] + last["byteLength"]
    assert end < F
    refused(patch(DATA, end, b"\x01"), "R6", "non-zero")


def _shape_cases() -> list[Any]:
    def drop(field: str) -> Any:
        return pytest.param(lambda m: m.pop(field), (field, "missing"), id=f"without-{field}")

    def differ(key: str, value: str) -> Any:
        return pytest.param(lambda m: m["payloads"][1].update({key: value}),
                            ("payloads[1]", "table entry 1"), id=f"payloads-{key}")

    return [
        *(drop(field) for field in MANIFEST_FIELDS),
        pytest.param(lambda m: m.update(host="h1"), ("'host'", "not a FLYSESS1 field"),
                     id="unknown-field"),
        pytest.param(lambda m: m.update(envelopeVersion=2), ("envelopeVersion 2",),
                     id="envelope-version-2"),
        pytest.param(lambda m: m["payloads"].pop(), ("5 items", "6"), id="payloads-short"),
        differ("name", "other"),
        differ("byteLength", "1"),
        differ("digest", digest_bytes(b"other")),
    ]


@pytest.mark.parametrize(("edit", "words"), _shape_cases())
def test_r7_manifest_shape(edit: Any, words: tuple[str, ...]) -> None:
    assert len(MANIFEST_FIELDS) == 14
    refused(with_manifest(edit), "R7", *words)


def test_r8_manifest_values() -> None:
    extra = [*PAYLOADS, ("extra", b"x")]
    refused(with_manifest(lambda m: m.update(payloads=listing(extra)), extra), "R8",
            "extra", "nothing references it")
    short = [p for p in PAYLOADS if p[0] != "task-ledger"]
    refused(with_manifest(lambda m: m.update(payloads=listing(short)), short), "R8",
            "dangling reference", "task-ledger")
    renamed = [("agent-fly-x" if n == "agent-fly-a" else n, b) for n, b in PAYLOADS]

    def misnamed(m: dict[str, Any]) -> None:
        m["agents"][0]["payload"] = "agent-fly-x"
        m["payloads"] = listing(renamed)
    refused(with_manifest(misnamed, renamed), "R8", "agents[0].payload", "agent-fly-a")

    def unsorted(m: dict[str, Any]) -> None:
        second = copy.deepcopy(m["agents"][0])
        second.update(agentId="fly-0", payload="agent-fly-0")
        m["agents"].append(second)
    refused(with_manifest(unsorted), "R8", "strictly sorted")
    refused(with_manifest(lambda m: m["coordinator"]["eventWatermarks"].update(
        lastSourceStep="3")), "R8", "lastSourceStep 3")
    refused(with_manifest(lambda m: m.update(
        worldTime={"numerator": "200000000", "denominator": "6"})), "R8", "worldTime",
        "not reduced")


def test_checks_run_in_order() -> None:
    # R3 (a non-canonical manifest) and R5 (a payload that does not match its digest)
    text = canonical(MANIFEST).replace(b":", b": ", 1)
    both = bytearray(raw_pack(text, PAYLOADS))
    first = struct.unpack_from("<Q", both, align8(32 + len(text)) + 64)[0]
    both[first] ^= 1
    refused(reseal(both), "R3")
    # R2 (footer digest) and R7 (an unknown manifest field)
    unknown = bytearray(with_manifest(lambda m: m.update(host="h1")))
    unknown[-20] ^= 1
    refused(bytes(unknown), "R2")
    refused(reseal(unknown), "R7")
    # and an intact file encodes back to itself
    assert encode(decode(DATA).manifest, PAYLOADS) == DATA


@pytest.mark.parametrize("case", DOC["corruptions"], ids=[c["id"] for c in DOC["corruptions"]])
def test_the_fixture_corruptions_are_refused(case: dict[str, Any]) -> None:
    data = bytearray(DATA)
    for edit in case["edits"]:
        new = bytes.fromhex(edit["hex"])
        assert data[edit["at"]:edit["at"] + len(new)] != new
        data[edit["at"]:edit["at"] + len(new)] = new
    if case["truncateTo"] is not None:
        data = data[:case["truncateTo"]]
    result = reseal(data) if case["reseal"] else bytes(data)
    assert result != DATA
    refused(result, case["check"])
    assert {c["check"] for c in DOC["corruptions"]} == {f"R{i}" for i in range(1, 9)}
