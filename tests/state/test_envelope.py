"""The FLYSESS1 envelope: the fixture, round trips, the encoder's refusals (state.md §10, 1–6)."""

from __future__ import annotations

import base64
import copy
import hashlib
import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flyd.state.envelope import (
    FOOTER_BYTES,
    MANIFEST_FIELDS,
    MAX_PAYLOADS,
    TABLE_ENTRY_BYTES,
    EnvelopeError,
    align8,
    decode,
    encode,
    pack,
    unpack,
    validate_manifest,
)
from workers.types.canonical import canonical, digest_bytes, digest_of
from workers.types.domain import DomainError, ErrorCode, Mutation

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint-envelope.json"
SCRIPT = ROOT / "scripts" / "make_checkpoint_fixture.py"


def load() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    return doc


def stored(doc: dict[str, Any]) -> bytes:
    return base64.b64decode(doc["envelope"], validate=True)


def bodies(doc: dict[str, Any]) -> list[tuple[str, bytes]]:
    return [(p["name"], p["utf8"].encode("utf-8")) for p in doc["payloads"]]


def listing(payloads: list[tuple[str, bytes]]) -> list[dict[str, str]]:
    return [{"name": n, "byteLength": str(len(b)), "digest": digest_bytes(b)} for n, b in payloads]


def internal(call: Any) -> DomainError:
    with pytest.raises(DomainError) as caught:
        call()
    assert not isinstance(caught.value, EnvelopeError)
    assert caught.value.code == ErrorCode.INTERNAL
    assert caught.value.mutation == Mutation.NONE
    return caught.value


def test_the_fixture_decodes_at_every_documented_offset() -> None:
    doc = load()
    data = stored(doc)
    layout = doc["layout"]
    header = layout["header"]
    assert header == {"magic": "FLYSESS1", "envelopeVersion": 1, "headerBytes": 32,
                      "manifestBytes": header["manifestBytes"], "payloadCount": 6,
                      "tableOffset": align8(32 + header["manifestBytes"]), "reserved": 0}
    magic, version, header_bytes, m, n, t, reserved = struct.unpack_from("<8sIIIIII", data, 0)
    assert (magic, version, header_bytes, reserved) == (b"FLYSESS1", 1, 32, 0)
    assert (m, n, t) == (header["manifestBytes"], 6, header["tableOffset"])
    assert data[32:32 + m] == canonical(doc["manifest"])
    assert data[32 + m:t] == bytes(t - 32 - m)
    names = [e["name"] for e in layout["entries"]]
    assert names == ["world", "agent-fly-a", "executor-fly-a", "task-ledger",
                     "prior-inspection", "coordinator-admission"]
    end = t + TABLE_ENTRY_BYTES * n
    for i, (entry, (name, body)) in enumerate(zip(layout["entries"], bodies(doc), strict=True)):
        at = t + TABLE_ENTRY_BYTES * i
        assert entry["tableEntryOffset"] == at
        raw_name, offset, length, digest = struct.unpack_from("<64sQQ32s", data, at)
        assert raw_name == name.encode("ascii").ljust(64, b"\0")
        assert offset == entry["offset"] == align8(end)
        assert length == entry["byteLength"] == len(body)
        assert digest.hex() == entry["digest"] == hashlib.sha256(body).hexdigest()
        assert data[end:offset] == bytes(offset - end)
        assert data[offset:offset + length] == body
        end = offset + length
    f = layout["footerOffset"]
    assert f == align8(end) and data[end:f] == bytes(f - end)
    assert layout["fileBytes"] == len(data) == f + FOOTER_BYTES
    file_bytes, footer_digest, footer_magic = struct.unpack_from("<Q32s8s", data, f)
    assert (file_bytes, footer_magic) == (len(data), b"FLYSESSF")
    assert footer_digest.hex() == layout["footerDigest"] == hashlib.sha256(data[:f]).hexdigest()

    envelope = decode(data)
    assert envelope.manifest == doc["manifest"]
    assert (envelope.layout.manifest_bytes, envelope.layout.table_offset,
            envelope.layout.footer_offset, envelope.layout.file_bytes) == (m, t, f, len(data))
    assert [(e.name, e.offset, e.byte_length, e.digest) for e in envelope.entries] == [
        (e["name"], e["offset"], e["byteLength"], e["digest"]) for e in layout["entries"]]
    assert list(envelope.payloads) == bodies(doc)
    assert envelope.payload("task-ledger") == dict(bodies(doc))["task-ledger"]
    assert envelope.checkpoint_id == "ckpt-1" and envelope.source_scope.step == 2


def test_encoding_the_fixture_is_byte_identical() -> None:
    doc = load()
    data = stored(doc)
    assert encode(doc["manifest"], bodies(doc)) == data
    envelope = decode(data)
    assert encode(envelope.manifest, envelope.payloads) == data
    # the committed generator reproduces the committed file byte for byte
    spec = importlib.util.spec_from_file_location("make_checkpoint_fixture", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.render().encode("utf-8") == FIXTURE.read_bytes()


_FIRST = "abcdefghijklmnopqrstuvwxyz0123456789"
_REST = _FIRST + "._-"
long_names = st.builds(lambda head, tail: head + tail, st.sampled_from(_FIRST),
                       st.text(alphabet=_REST, min_size=63, max_size=63))


@settings(max_examples=40, deadline=None)
@given(names=st.lists(long_names, min_size=0, max_size=MAX_PAYLOADS, unique=True),
       sizes=st.lists(st.integers(0, 40), min_size=MAX_PAYLOADS, max_size=MAX_PAYLOADS),
       note=st.text(alphabet=_REST, max_size=20))
def test_decode_then_encode_round_trips(names: list[str], sizes: list[int], note: str) -> None:
    payloads = [(name, bytes([i % 251 + 1]) * size)
                for i, (name, size) in enumerate(zip(names, sizes, strict=False))]
    manifest_bytes = canonical({"note": note})
    data = pack(manifest_bytes, payloads)
    layout = unpack(data)
    assert pack(layout.manifest_text, layout.payloads) == data
    assert list(layout.payloads) == payloads
    assert len(data) % 8 == 0 and layout.table_offset % 8 == 0
    m = len(manifest_bytes)
    assert data[32 + m:layout.table_offset] == bytes(layout.table_offset - 32 - m)
    end = layout.table_offset + TABLE_ENTRY_BYTES * len(payloads)
    for index, entry in enumerate(layout.entries):
        assert entry.offset % 8 == 0
        assert data[end:entry.offset] == bytes(entry.offset - end)
        at = layout.table_offset + TABLE_ENTRY_BYTES * index
        assert data[at:at + 64] == entry.name.encode("ascii")  # 64 characters: no NUL
        end = entry.offset + entry.byte_length
    assert layout.footer_offset == align8(end) == len(data) - FOOTER_BYTES
    assert data[end:layout.footer_offset] == bytes(layout.footer_offset - end)

    # the same names as helper payloads of a real checkpoint: encode/decode round trip
    helpers = payloads[:MAX_PAYLOADS - 6]
    doc = load()
    manifest = copy.deepcopy(doc["manifest"])
    checkpoint = bodies(doc) + helpers
    manifest["helperState"] = [name for name, _ in helpers]
    manifest["payloads"] = listing(checkpoint)
    encoded = encode(manifest, checkpoint)
    envelope = decode(encoded)
    assert encode(envelope.manifest, envelope.payloads) == encoded
    assert list(envelope.payloads) == checkpoint


def test_the_encoder_refuses_what_no_reader_accepts() -> None:
    doc = load()
    manifest, payloads = doc["manifest"], bodies(doc)

    many = payloads + [(f"helper-{i}", b"x") for i in range(MAX_PAYLOADS + 1 - len(payloads))]
    assert len(many) == MAX_PAYLOADS + 1 == 1025
    too_many = copy.deepcopy(manifest)
    too_many["helperState"] = [name for name, _ in many[6:]]
    too_many["payloads"] = listing(many)
    assert "1025 payloads" in internal(lambda: encode(too_many, many)).message
    internal(lambda: pack(canonical({}), many))

    duplicate = [*payloads, ("world", b"again")]
    assert "twice" in internal(lambda: encode(manifest, duplicate)).message
    upper = [("World", payloads[0][1]), *payloads[1:]]
    assert "not an Id" in internal(lambda: encode(manifest, upper)).message

    disagreeing = copy.deepcopy(manifest)
    disagreeing["payloads"][2]["digest"] = digest_bytes(b"other")
    assert "payloads" in internal(lambda: encode(disagreeing, payloads)).message
    reordered = list(reversed(payloads))
    internal(lambda: encode(manifest, reordered))

    invalid = copy.deepcopy(manifest)
    invalid["agents"][0]["seed"] = "7"
    assert "R8" in internal(lambda: encode(invalid, payloads)).message
    unknown = copy.deepcopy(manifest)
    unknown["runId"] = "run-1"
    assert "R7" in internal(lambda: encode(unknown, payloads)).message
    internal(lambda: pack(b'{"a": 1}', payloads))  # not canonical: R3 would refuse it


TRANSIENT = ("incarnation", "runid", "run_id", "lease", "timestamp", "createdat", "host",
             "path", "pid", "artifact")


def _keys(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [k for key, item in value.items() for k in [key, *_keys(item)]]
    if isinstance(value, list):
        return [k for item in value for k in _keys(item)]
    return []


def test_a_manifest_is_closed_and_carries_no_transient_identity() -> None:
    doc = load()
    manifest = decode(stored(doc)).manifest
    assert tuple(manifest) == tuple(sorted(MANIFEST_FIELDS)) and len(MANIFEST_FIELDS) == 14
    assert manifest["helperState"] == []
    for key in _keys(manifest):
        assert not any(word in key.lower() for word in TRANSIENT), key
    for extra in ("incarnationId", "runId", "leaseEpoch", "timestamp"):
        top = copy.deepcopy(manifest)
        top[extra] = "x"
        with pytest.raises(EnvelopeError) as caught:
            validate_manifest(top)
        assert caught.value.check == "R7" and extra in caught.value.message
        nested = copy.deepcopy(manifest)
        nested["agents"][0][extra] = "x"
        with pytest.raises(EnvelopeError) as caught:
            validate_manifest(nested)
        assert caught.value.check == "R8" and extra in caught.value.message
    # the same state captured under the same id encodes to the same bytes
    assert encode(copy.deepcopy(doc["manifest"]), bodies(doc)) == stored(doc)


def test_the_canonical_json_vector() -> None:
    value = {"b": [1, "x"], "a": {"d": True, "c": None}}
    assert canonical(value) == b'{"a":{"c":null,"d":true},"b":[1,"x"]}'
    assert digest_of(value) == "49bd9631390b56109ef9a77080d397067fdd5bfde2d9f67de64a11d73af2e3d3"
    doc = load()
    floated = copy.deepcopy(doc["manifest"])
    floated["agents"][0]["seed"] = 7.0
    assert "float" in internal(lambda: encode(floated, bodies(doc))).message
    # a float that reaches a reader is refused by R8 (seed is an I32, not a number)
    text = canonical(doc["manifest"]).replace(b'"seed":7', b'"seed":7.5')
    with pytest.raises(EnvelopeError) as caught:
        decode(pack(text, bodies(doc)))
    assert caught.value.check == "R8" and "seed" in caught.value.message
