"""Generate tests/fixtures/checkpoint-envelope.json (state.md §10 tests 1, 2 and 16).

Why: the envelope tests need one small, real FLYSESS1 file whose every offset is written down,
and a list of corruptions against it, so a reader in any language can be checked against the
same bytes. The file is generated, never edited: running this script again reproduces it byte
for byte (`tests/state/test_envelope.py` checks that).

The checkpoint: session `demo`, epoch `e1`, boundary 2, one agent `fly-a` on port `p1` (seed 7,
the arena-direct profile and graph variant 0 vectors of session.md §4.7), the counter arena with
one port at 60 Hz (its compatibility block from the real descriptor). Six payloads in §2.5 order:
`world`, `agent-fly-a`, `executor-fly-a`, `task-ledger`, `prior-inspection`,
`coordinator-admission`. The payload bodies are short canonical stand-ins with the §6.3 header
members (`payloadVersion`, `kind`, `checkpointId`, `committedStep`): the envelope never reads
payloads, it only places and hashes them.

Each corruption is data: `edits` (`{"at": offset, "hex": bytes}` replacing bytes in place), then
`truncateTo` (a length, or null), then `reseal` (rewrite fileBytes and the footer digest, so the
checks after R2 are reachable); `check` is the reader check that must refuse the result.

Usage: `python scripts/make_checkpoint_fixture.py` (writes the file), `--check` (exit 1 when the
stored file differs from what this script generates).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any, Final

from flyd.state.compat import Compatibility
from flyd.state.envelope import (
    FOOTER_BYTES,
    HEADER_BYTES,
    TABLE_ENTRY_BYTES,
    decode,
    encode,
    payload_names,
)
from workers.composition import composition_digest
from workers.synthetic.arena import CounterArena
from workers.types.canonical import canonical, digest_bytes
from workers.types.ticks import RationalNs

TARGET: Final = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / \
    "checkpoint-envelope.json"

CHECKPOINT_ID: Final = "ckpt-1"
SESSION: Final = "demo"
EPOCH: Final = "e1"
STEP: Final = 2
AGENT: Final = "fly-a"
PORT: Final = "p1"
WORLD: Final = "arena"
STEP_DURATION: Final = RationalNs(50_000_000, 3)
# session.md §4.7 vectors for fly-a (tick 1000000/1, warm-up 10, graph variant 0)
PROFILE_DIGEST: Final = "e50a471c6327ca4d9295c7efaebba8b4e2f8d08bcefc0b10b2a513e7f8d0a08c"
DATASET_DIGEST: Final = "3abe76e912cb936270c4d84c7407a663663d965e0b0c5df526d51302ddebd29c"
INDEX_DIGEST: Final = "479093e456fee800e2a827d35fc37b94d0b9e053d261964c0e598d290b0dc423"
# a stand-in contract digest: compositionDigest is provenance only and never compared
CONTRACT_DIGEST: Final = digest_bytes(b"checkpoint-envelope fixture contract\n")


def _scope() -> dict[str, str]:
    return {"sessionId": SESSION, "epoch": EPOCH, "step": str(STEP)}


def _wrapper(kind: str, **members: Any) -> bytes:
    return canonical({"payloadVersion": 1, "kind": kind, "checkpointId": CHECKPOINT_ID,
                      "committedStep": str(STEP), **members})


def payloads() -> list[tuple[str, bytes]]:
    arena = {"format": "counter-arena-v1", "counter": 1, "audioPhase": 0}
    return [
        ("world", _wrapper("world", sourceScope=_scope(), workerId=WORLD, episodeId="ep1",
                           bindings=[[PORT, AGENT]],
                           world=arena)),
        (f"agent-{AGENT}", _wrapper("agent", sourceScope=_scope(), agentId=AGENT)),
        (f"executor-{AGENT}", _wrapper("executor", agentId=AGENT)),
        ("task-ledger", _wrapper("task-ledger", contexts=[])),
        ("prior-inspection", _wrapper("prior-inspection", inspection={"counter": 1})),
        ("coordinator-admission", _wrapper("coordinator-admission", admissions=[])),
    ]


def manifest(bodies: list[tuple[str, bytes]]) -> dict[str, Any]:
    arena = CounterArena(world_id=WORLD, ports=[PORT], step=STEP_DURATION,
                         observation_delay_steps=0, threads=1, config={})
    return {
        "envelopeVersion": 1,
        "checkpointId": CHECKPOINT_ID,
        "sourceScope": _scope(),
        "episodeId": "ep1",
        "worldTime": STEP_DURATION.times(STEP).to_json(),
        "schedulerId": "lockstep-v1",
        "compositionDigest": composition_digest(SESSION, EPOCH, CONTRACT_DIGEST,
                                                [(AGENT, PORT, PROFILE_DIGEST)]),
        "portMap": [{"portId": PORT, "agentId": AGENT}],
        "compatibility": Compatibility.of(arena.descriptor()).to_json(),
        "agents": [{
            "agentId": AGENT,
            "profileDigest": PROFILE_DIGEST,
            "datasetDigest": DATASET_DIGEST,
            "indexDigest": INDEX_DIGEST,
            "modelVersion": "fake-brain-v1",
            "plasticityVersion": "fake-reinforce-v1",
            "seed": 7,
            "brainTicks": "43",
            "remainder": {"numerator": "1000000", "denominator": "3"},
            "payload": f"agent-{AGENT}",
        }],
        "environment": {"workerId": WORLD, "payload": "world"},
        "helperState": [],
        "coordinator": {
            "taskLedger": "task-ledger",
            "priorInspection": "prior-inspection",
            "executorState": [{"agentId": AGENT, "payload": f"executor-{AGENT}"}],
            "admissionState": "coordinator-admission",
            "eventWatermarks": {"lastSourceStep": "1", "issued": "12"},
        },
        "payloads": [{"name": name, "byteLength": str(len(body)), "digest": digest_bytes(body)}
                     for name, body in bodies],
    }


def _edit(at: int, data: bytes) -> dict[str, Any]:
    return {"at": at, "hex": data.hex()}


def _find(data: bytes, needle: bytes, start: int, end: int) -> int:
    """The offset of the one occurrence of `needle` in data[start:end]."""
    at = data.find(needle, start, end)
    if at < 0 or data.find(needle, at + 1, end) >= 0:
        raise SystemExit(f"fixture: {needle!r} must occur exactly once in the manifest")
    return at


def corruptions(data: bytes, layout: dict[str, Any]) -> list[dict[str, Any]]:
    m = layout["header"]["manifestBytes"]
    t = layout["header"]["tableOffset"]
    f = layout["footerOffset"]
    entries = layout["entries"]
    first, last = entries[0], entries[-1]
    manifest_end = HEADER_BYTES + m
    gap_after_last = last["offset"] + last["byteLength"]
    if not (manifest_end < t and gap_after_last < f and first["byteLength"] % 8):
        raise SystemExit("fixture: the layout needs manifest padding and payload gaps")
    worldtime = _find(data, b'"denominator":"3","numerator":"100000000"', HEADER_BYTES,
                      manifest_end)
    watermark = _find(data, b'"lastSourceStep":"1"', HEADER_BYTES, manifest_end)
    second_name = entries[1]["tableEntryOffset"]

    def case(name: str, check: str, edits: list[dict[str, Any]], *, reseal: bool = True,
             truncate_to: int | None = None, what: str) -> dict[str, Any]:
        return {"id": name, "check": check, "edits": edits, "truncateTo": truncate_to,
                "reseal": reseal, "what": what}

    return [
        case("r1-short", "R1", [], truncate_to=79, reseal=False,
             what="79 bytes, one short of header and footer"),
        case("r1-other-magic", "R1", [_edit(0, b"OTHERFMT")], reseal=False,
             what="another format's magic"),
        case("r1-version-2", "R1", [_edit(8, struct.pack("<I", 2))],
             what="envelopeVersion 2"),
        case("r1-reserved", "R1", [_edit(28, struct.pack("<I", 1))], what="reserved 1"),
        case("r2-footer-magic", "R2", [_edit(f + 40, b"FLYSESSX")], reseal=False,
             what="footer magic"),
        case("r2-payload-flip-unsealed", "R2",
             [_edit(first["offset"], bytes([data[first["offset"]] ^ 0x01]))], reseal=False,
             what="a payload byte flipped without resealing"),
        case("r3-invalid-utf8", "R3", [_edit(HEADER_BYTES + 2, b"\xff")],
             what="invalid UTF-8 inside the first manifest key"),
        case("r3-manifest-past-footer", "R3", [_edit(16, struct.pack("<I", f))],
             what="manifestBytes reaching past the footer"),
        case("r4-padding", "R4", [_edit(manifest_end, b"\x20")],
             what="a space in the padding after the manifest"),
        case("r4-table-offset", "R4", [_edit(24, struct.pack("<I", t + 8))],
             what="tableOffset + 8"),
        case("r5-uppercase-name", "R5", [_edit(first["tableEntryOffset"], b"W")],
             what="entry 0 named World"),
        case("r5-duplicate-name", "R5",
             [_edit(second_name, b"world".ljust(64, b"\0"))],
             what="entry 1 renamed world"),
        case("r5-digest", "R5",
             [_edit(first["offset"], bytes([data[first["offset"]] ^ 0x01]))],
             what="a payload byte flipped, resealed"),
        case("r5-gap", "R5",
             [_edit(first["offset"] + first["byteLength"], b"\x01")],
             what="a non-zero byte in the gap after payload 0"),
        case("r6-tail-gap", "R6", [_edit(gap_after_last, b"\x01")],
             what="a non-zero byte between the last payload and the footer"),
        case("r7-envelope-version", "R7",
             [_edit(_find(data, b'"envelopeVersion":1', HEADER_BYTES, manifest_end)
                    + len(b'"envelopeVersion":'), b"2")],
             what="manifest envelopeVersion 2"),
        case("r8-last-source-step", "R8",
             [_edit(watermark + len(b'"lastSourceStep":"'), b"9")],
             what="eventWatermarks.lastSourceStep 9 above the source step 2"),
        case("r8-world-time-not-reduced", "R8",
             [_edit(worldtime + len(b'"denominator":"'), b"2")],
             what="worldTime 100000000/2, not reduced"),
    ]


def _layout(data: bytes) -> dict[str, Any]:
    envelope = decode(data)
    magic, version, header_bytes, m, n, t, reserved = struct.unpack_from("<8sIIIIII", data, 0)
    f = envelope.layout.footer_offset
    return {
        "header": {"magic": magic.decode("ascii"), "envelopeVersion": version,
                   "headerBytes": header_bytes, "manifestBytes": m, "payloadCount": n,
                   "tableOffset": t, "reserved": reserved},
        "entries": [{"index": i, "tableEntryOffset": t + TABLE_ENTRY_BYTES * i,
                     "name": e.name, "offset": e.offset, "byteLength": e.byte_length,
                     "digest": e.digest} for i, e in enumerate(envelope.entries)],
        "footerOffset": f,
        "fileBytes": f + FOOTER_BYTES,
        "footerDigest": hashlib.sha256(data[:f]).hexdigest(),
    }


def render() -> str:
    """The fixture file's exact text."""
    bodies = payloads()
    doc = manifest(bodies)
    if [name for name, _ in bodies] != payload_names([AGENT]):
        raise SystemExit("fixture: payloads out of §2.5 order")
    data = encode(doc, bodies)
    layout = _layout(data)
    fixture = {
        "about": "A FLYSESS1 checkpoint envelope (state.md §2): one agent, six payloads. "
                 "Generated by scripts/make_checkpoint_fixture.py; do not edit.",
        "manifest": doc,
        "payloads": [{"name": name, "utf8": body.decode("utf-8")} for name, body in bodies],
        "envelope": base64.b64encode(data).decode("ascii"),
        "layout": layout,
        "corruptions": corruptions(data, layout),
    }
    return json.dumps(fixture, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        return 0 if TARGET.read_text(encoding="utf-8") == text else 1
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
