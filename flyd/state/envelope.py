"""The FLYSESS1 checkpoint envelope: byte layout, manifest, reader checks (design/state.md §2).

Why: a checkpoint outlives the processes, releases and hosts that wrote it, so its bytes are a
format with exactly one valid spelling (`encode(decode(b)) == b`), and a reader refuses a
damaged, foreign or inconsistent file on its *first* defect, never on a value derived from one.

Layout (all integers unsigned little-endian, `align8(x) = (x + 7) & ~7`):

    0    header   32 B   magic FLYSESS1, envelopeVersion 1, headerBytes 32, manifestBytes M,
                         payloadCount n (0..64), tableOffset T = align8(32 + M), reserved 0
    32   manifest M B    canonical JSON, then zero bytes up to T
    T    table    112·n  per payload: name (64 B ASCII Id, NUL-padded), u64 offset,
                         u64 byteLength, SHA-256 of exactly those bytes
    P₀ = T + 112·n       payload i at Pᵢ = align8(Pᵢ₋₁ + lenᵢ₋₁); gaps are zero
    F = align8(end of the last payload) (P₀ when n = 0)
    F    footer   48 B   u64 fileBytes (= F + 48), SHA-256 of [0, F), FLYSESSF

Reader checks, in this order (each failure is `EnvelopeError(check, reason)`, a `DomainError`
`INCOMPATIBLE_STATE`/`none` with the message `"envelope <check>: <reason>"`):

    R1 header    length >= 80; magic (another format's magic is named); version 1;
                 headerBytes 32; reserved 0; payloadCount <= 64
    R2 footer    F = length - 48; magic FLYSESSF; fileBytes = length; SHA-256 of [0, F)
    R3 manifest  32 + M <= F; bytes [32, 32+M) parse strictly and are canonical
    R4 table     T = align8(32 + M); bytes [32+M, T) zero; T + 112·n <= F
    R5 entries   per entry: the name is an ASCII Id before the first NUL, zero after it;
                 offset = align8(previous end) (the first: T + 112·n) with a zero gap;
                 offset + byteLength <= F; SHA-256 matches; the name is new
    R6 tail      align8(last end) = F and the bytes between are zero
    R7 shape     an object with exactly the 14 fields (`MANIFEST_FIELDS`); envelopeVersion the
                 integer 1; `payloads` repeats the table item by item
    R8 values    `validate_manifest`: the types of design/state.md §2.4, sorting, port map,
    design/state.md §2.5 names and
                 order, every reference resolved and every entry referenced exactly once,
                 lastSourceStep <= sourceScope.step

The encoder refuses (`INTERNAL`/`none`, a caller bug) everything no reader accepts.

Layers. `unpack`/`pack` are the byte layout alone (R1–R6, any canonical JSON as the manifest):
tools and tests use them to read or lay out files whose manifest is not (yet) a checkpoint's.
`decode` is the reader (`unpack`, then R7, then R8); `encode` is the writer (R7/R8 conditions on
the manifest, the table from the payload list, then `pack`). Every checkpoint is written by
`encode` and read by `decode`.

Decisions where the spec is silent:

- `decode` runs all of R1–R8 (it calls `validate_manifest` last), so no reader can forget R8;
  `validate_manifest` alone checks R7's table-independent part (closed field set,
  envelopeVersion) before R8, so `encode` can call it on a manifest that has no bytes yet.
- R8 accepts any non-empty `helperState` whose names are unique Ids with payloads in the table
  after `coordinator-admission`: it is a format rule, and v1's refusal of helper state belongs
  to the restore (state.md test 76), which must be able to read such a file to refuse it.
- R8 accepts an empty agent list; the spec bounds the list only by sorting and the port map.
- `encode` refuses a float anywhere in the manifest before writing it (manifests hold none;
  canonical JSON would otherwise spell `7.0` as `7` and hide the caller's bug).
- Large encodes belong in a worker thread (`asyncio.to_thread(encode, …)`); this module is pure
  and synchronous.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from flyd.state.compat import Compatibility
from workers.types.canonical import canonical, digest_bytes, is_canonical, parse_strict, plain
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    Scope,
    is_id,
    parse_digest,
    parse_i32,
    parse_id,
    parse_u64,
    short,
)
from workers.types.ticks import RationalNs

__all__ = [
    "ALIGNMENT",
    "CHECKPOINT_CAPABILITY",
    "COORDINATOR_ADMISSION",
    "ENVELOPE_VERSION",
    "FOOTER_BYTES",
    "FOOTER_MAGIC",
    "HEADER_BYTES",
    "MAGIC",
    "MANIFEST_FIELDS",
    "MAX_ENVELOPE_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_PAYLOADS",
    "MIN_ENVELOPE_BYTES",
    "NAME_BYTES",
    "PAYLOAD_CONTENT_TYPE",
    "PRIOR_INSPECTION",
    "SCHEDULER_ID",
    "TABLE_ENTRY_BYTES",
    "TASK_LEDGER",
    "WORLD_PAYLOAD",
    "Envelope",
    "EnvelopeError",
    "Layout",
    "PayloadEntry",
    "align8",
    "decode",
    "encode",
    "pack",
    "payload_names",
    "unpack",
    "validate_manifest",
]

MAGIC: Final = b"FLYSESS1"
FOOTER_MAGIC: Final = b"FLYSESSF"
ENVELOPE_VERSION: Final = 1
HEADER_BYTES: Final = 32
TABLE_ENTRY_BYTES: Final = 112
NAME_BYTES: Final = 64
FOOTER_BYTES: Final = 48
ALIGNMENT: Final = 8
MAX_PAYLOADS: Final = 1024
MIN_ENVELOPE_BYTES: Final = HEADER_BYTES + FOOTER_BYTES
MAX_ENVELOPE_BYTES: Final = 2**30 - 1
MAX_MANIFEST_BYTES: Final = 2**32 - 1
CHECKPOINT_CAPABILITY: Final = "checkpoint-v1"
PAYLOAD_CONTENT_TYPE: Final = "application/x-flyd-state"
SCHEDULER_ID: Final = "lockstep-v1"

WORLD_PAYLOAD: Final = "world"
TASK_LEDGER: Final = "task-ledger"
PRIOR_INSPECTION: Final = "prior-inspection"
COORDINATOR_ADMISSION: Final = "coordinator-admission"

MANIFEST_FIELDS: Final[tuple[str, ...]] = (
    "envelopeVersion",
    "checkpointId",
    "sourceScope",
    "episodeId",
    "worldTime",
    "schedulerId",
    "compositionDigest",
    "portMap",
    "compatibility",
    "agents",
    "environment",
    "helperState",
    "coordinator",
    "payloads",
)

_HEADER: Final = struct.Struct("<8sIIIIII")
_ENTRY: Final = struct.Struct(f"<{NAME_BYTES}sQQ32s")
_FOOTER: Final = struct.Struct("<Q32s8s")
_AGENT_FIELDS: Final = (
    "agentId", "profileDigest", "datasetDigest", "indexDigest", "modelVersion",
    "plasticityVersion", "seed", "brainTicks", "remainder", "payload",
)
_COORDINATOR_FIELDS: Final = (
    "taskLedger", "priorInspection", "executorState", "admissionState", "eventWatermarks",
)


def align8(offset: int) -> int:
    return (offset + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


class EnvelopeError(DomainError):
    """A reader check failed: `INCOMPATIBLE_STATE`/`none`, `"envelope <check>: <reason>"`."""

    __slots__ = ("check", "reason")

    def __init__(self, check: str, reason: str) -> None:
        super().__init__(ErrorCode.INCOMPATIBLE_STATE, f"envelope {check}: {reason}",
                         Mutation.NONE)
        self.check = check
        self.reason = reason


def _internal(reason: str) -> DomainError:
    return DomainError(ErrorCode.INTERNAL, f"envelope encode: {reason}", Mutation.NONE)


@dataclass(frozen=True, slots=True)
class PayloadEntry:
    """One table entry: where a payload lies and what it hashes to."""

    name: str
    offset: int
    byte_length: int
    digest: str

    def listing(self) -> dict[str, str]:
        """The manifest's `payloads` item for this entry."""
        return {"name": self.name, "byteLength": str(self.byte_length), "digest": self.digest}


@dataclass(frozen=True, slots=True)
class Layout:
    """An envelope that passed R1–R6: the bytes, where everything lies, the parsed manifest."""

    data: bytes
    manifest_bytes: int
    table_offset: int
    footer_offset: int
    entries: tuple[PayloadEntry, ...]
    manifest: Any

    @property
    def file_bytes(self) -> int:
        return len(self.data)

    @property
    def manifest_text(self) -> bytes:
        return self.data[HEADER_BYTES:HEADER_BYTES + self.manifest_bytes]

    @property
    def payloads(self) -> tuple[tuple[str, bytes], ...]:
        """`(name, bytes)` in write order: what `pack`/`encode` take."""
        return tuple((e.name, self.data[e.offset:e.offset + e.byte_length])
                     for e in self.entries)

    def payload(self, name: str) -> bytes:
        for entry in self.entries:
            if entry.name == name:
                return self.data[entry.offset:entry.offset + entry.byte_length]
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class Envelope:
    """A checkpoint that passed every reader check (R1–R8)."""

    layout: Layout
    manifest: dict[str, Any]

    @property
    def data(self) -> bytes:
        return self.layout.data

    @property
    def entries(self) -> tuple[PayloadEntry, ...]:
        return self.layout.entries

    @property
    def payloads(self) -> tuple[tuple[str, bytes], ...]:
        return self.layout.payloads

    def payload(self, name: str) -> bytes:
        return self.layout.payload(name)

    @property
    def checkpoint_id(self) -> str:
        checkpoint_id: str = self.manifest["checkpointId"]
        return checkpoint_id

    @property
    def source_scope(self) -> Scope:
        return Scope.from_json(self.manifest["sourceScope"])

    @property
    def compatibility(self) -> Compatibility:
        return Compatibility.from_json(self.manifest["compatibility"])


# --------------------------------------------------------------------------------------------
# Layout: pack / unpack (R1–R6)


def _zero(data: bytes, start: int, end: int) -> int | None:
    """The offset of the first non-zero byte in [start, end), or None."""
    for index in range(start, end):
        if data[index]:
            return index
    return None


def _magic_text(raw: bytes) -> str:
    return raw.decode("ascii", "backslashreplace")


def _check_header(data: bytes) -> tuple[int, int, int]:
    if len(data) < MIN_ENVELOPE_BYTES:
        raise EnvelopeError("R1", f"{len(data)} bytes is shorter than the "
                                  f"{MIN_ENVELOPE_BYTES}-byte minimum")
    magic, version, header_bytes, m, n, t, reserved = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise EnvelopeError("R1", f"magic {_magic_text(magic)!r} is not FLYSESS1 "
                                  "(not a flyd checkpoint)")
    if version != ENVELOPE_VERSION:
        raise EnvelopeError("R1", f"envelopeVersion {version} is not {ENVELOPE_VERSION}")
    if header_bytes != HEADER_BYTES:
        raise EnvelopeError("R1", f"headerBytes {header_bytes} is not {HEADER_BYTES}")
    if reserved != 0:
        raise EnvelopeError("R1", f"the reserved header field is {reserved}, not 0")
    if n > MAX_PAYLOADS:
        raise EnvelopeError("R1", f"payloadCount {n} exceeds {MAX_PAYLOADS}")
    return m, n, t


def _check_footer(data: bytes) -> int:
    f = len(data) - FOOTER_BYTES
    file_bytes, digest, magic = _FOOTER.unpack_from(data, f)
    if magic != FOOTER_MAGIC:
        raise EnvelopeError("R2", f"footer magic {_magic_text(magic)!r} is not FLYSESSF")
    if file_bytes != len(data):
        raise EnvelopeError("R2", f"fileBytes {file_bytes} differs from the length "
                                  f"{len(data)}")
    if hashlib.sha256(memoryview(data)[:f]).digest() != digest:
        raise EnvelopeError("R2", f"the SHA-256 of bytes [0, {f}) does not match the footer")
    return f


def _check_manifest_bytes(data: bytes, m: int, f: int) -> Any:
    end = HEADER_BYTES + m
    if end > f:
        raise EnvelopeError("R3", f"the manifest of {m} bytes ends at {end}, past the footer "
                                  f"at {f}")
    raw = data[HEADER_BYTES:end]
    try:
        manifest = parse_strict(raw)
    except DomainError as exc:
        raise EnvelopeError("R3", f"the manifest is not strict JSON: {exc.message}") from None
    if canonical(manifest) != raw:
        raise EnvelopeError("R3", "the manifest is not canonical JSON")
    return manifest


def _check_table(data: bytes, m: int, n: int, t: int, f: int) -> None:
    expected = align8(HEADER_BYTES + m)
    if t != expected:
        raise EnvelopeError("R4", f"tableOffset {t} is not align8(32 + {m}) = {expected}")
    dirty = _zero(data, HEADER_BYTES + m, t)
    if dirty is not None:
        raise EnvelopeError("R4", f"non-zero padding after the manifest at byte {dirty}")
    end = t + TABLE_ENTRY_BYTES * n
    if end > f:
        raise EnvelopeError("R4", f"the table of {n} entries ends at {end}, past the footer "
                                  f"at {f}")


def _entry_name(raw: bytes, index: int) -> str:
    nul = raw.find(b"\0")
    head = raw if nul < 0 else raw[:nul]
    if nul >= 0 and raw[nul:].count(0) != len(raw) - nul:
        raise EnvelopeError("R5", f"entry {index}: a non-zero byte follows the name's NUL")
    name = head.decode("ascii", "backslashreplace")
    if not head.isascii() or not is_id(name):
        raise EnvelopeError("R5", f"entry {index}: name {name!r} is not an ASCII Id")
    return name


def _check_entries(data: bytes, n: int, t: int,
                   f: int) -> tuple[tuple[PayloadEntry, ...], int]:
    entries: list[PayloadEntry] = []
    seen: set[str] = set()
    end = t + TABLE_ENTRY_BYTES * n
    for index in range(n):
        raw_name, offset, length, digest = _ENTRY.unpack_from(data, t + TABLE_ENTRY_BYTES * index)
        name = _entry_name(raw_name, index)
        expected = align8(end)
        if offset != expected:
            raise EnvelopeError("R5", f"entry {index} ({name}): offset {offset} is not "
                                      f"align8({end}) = {expected}")
        dirty = _zero(data, end, offset)
        if dirty is not None:
            raise EnvelopeError("R5", f"entry {index} ({name}): non-zero gap byte at {dirty}")
        if offset + length > f:
            raise EnvelopeError("R5", f"entry {index} ({name}): {length} bytes at {offset} "
                                      f"run past the footer at {f}")
        actual = hashlib.sha256(memoryview(data)[offset:offset + length]).digest()
        if actual != digest:
            raise EnvelopeError("R5", f"entry {index} ({name}): the payload's SHA-256 "
                                      f"{actual.hex()} differs from the table's {digest.hex()}")
        if name in seen:
            raise EnvelopeError("R5", f"entry {index}: the name {name} appears twice")
        seen.add(name)
        entries.append(PayloadEntry(name, offset, length, digest.hex()))
        end = offset + length
    return tuple(entries), end


def unpack(data: bytes | bytearray | memoryview) -> Layout:
    """R1–R6: the byte layout, with any canonical JSON as the manifest."""
    raw = bytes(data)
    m, n, t = _check_header(raw)
    f = _check_footer(raw)
    manifest = _check_manifest_bytes(raw, m, f)
    _check_table(raw, m, n, t, f)
    entries, last_end = _check_entries(raw, n, t, f)
    if align8(last_end) != f:
        raise EnvelopeError("R6", f"the last payload ends at {last_end}; align8 is "
                                  f"{align8(last_end)} but the footer starts at {f}")
    dirty = _zero(raw, last_end, f)
    if dirty is not None:
        raise EnvelopeError("R6", f"non-zero byte {dirty} between the last payload and the "
                                  "footer")
    return Layout(raw, m, t, f, entries, manifest)


def _check_names(payloads: Sequence[tuple[str, bytes]]) -> None:
    if len(payloads) > MAX_PAYLOADS:
        raise _internal(f"{len(payloads)} payloads exceed {MAX_PAYLOADS}")
    seen: set[str] = set()
    for name, _ in payloads:
        if not is_id(name):
            raise _internal(f"payload name {short(name)} is not an Id")
        if name in seen:
            raise _internal(f"payload name {name} appears twice")
        seen.add(name)


def pack(manifest_bytes: bytes, payloads: Sequence[tuple[str, bytes]]) -> bytes:
    """Lay out canonical manifest bytes and named payloads; refuses what `unpack` refuses."""
    _check_names(payloads)
    m = len(manifest_bytes)
    if m > MAX_MANIFEST_BYTES:
        raise _internal(f"a manifest of {m} bytes exceeds 2^32-1")
    if not is_canonical(manifest_bytes):
        raise _internal("the manifest bytes are not canonical JSON")
    t = align8(HEADER_BYTES + m)
    offsets: list[int] = []
    end = t + TABLE_ENTRY_BYTES * len(payloads)
    for _, body in payloads:
        offsets.append(align8(end))
        end = offsets[-1] + len(body)
    f = align8(end)
    size = f + FOOTER_BYTES
    if size > MAX_ENVELOPE_BYTES:
        raise _internal(f"an envelope of {size} bytes exceeds {MAX_ENVELOPE_BYTES}")
    out = bytearray(size)
    _HEADER.pack_into(out, 0, MAGIC, ENVELOPE_VERSION, HEADER_BYTES, m, len(payloads), t, 0)
    out[HEADER_BYTES:HEADER_BYTES + m] = manifest_bytes
    for index, ((name, body), offset) in enumerate(zip(payloads, offsets, strict=True)):
        _ENTRY.pack_into(out, t + TABLE_ENTRY_BYTES * index, name.encode("ascii"), offset,
                         len(body), hashlib.sha256(body).digest())
        out[offset:offset + len(body)] = body
    _FOOTER.pack_into(out, f, size, hashlib.sha256(memoryview(out)[:f]).digest(), FOOTER_MAGIC)
    return bytes(out)


# --------------------------------------------------------------------------------------------
# Manifest: shape (R7) and values (R8)


def _check_fields(manifest: Any) -> dict[str, Any]:
    if not isinstance(manifest, dict):
        raise EnvelopeError("R7", f"the manifest is not an object; got {short(manifest)}")
    for name in MANIFEST_FIELDS:
        if name not in manifest:
            raise EnvelopeError("R7", f"the manifest field {name} is missing")
    extra = sorted(key for key in manifest if key not in MANIFEST_FIELDS)
    if extra:
        raise EnvelopeError("R7", f"the manifest field {short(extra[0])} is not a FLYSESS1 "
                                  "field")
    version = manifest["envelopeVersion"]
    if type(version) is not int or version != ENVELOPE_VERSION:
        raise EnvelopeError("R7", f"envelopeVersion {short(version)} is not the integer "
                                  f"{ENVELOPE_VERSION}")
    return manifest


def _check_listing(manifest: dict[str, Any], entries: Sequence[PayloadEntry]) -> None:
    listed = manifest["payloads"]
    if not isinstance(listed, list) or len(listed) != len(entries):
        count = len(listed) if isinstance(listed, list) else short(listed)
        raise EnvelopeError("R7", f"payloads lists {count} items; the table has {len(entries)}")
    for index, (item, entry) in enumerate(zip(listed, entries, strict=True)):
        if item != entry.listing():
            raise EnvelopeError("R7", f"payloads[{index}] {short(item, 120)} differs from "
                                      f"table entry {index} {entry.listing()}")


def _object(value: Any, fields: Sequence[str], what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DomainError.invalid(f"{what} must be an object; got {short(value)}")
    for name in fields:
        if name not in value:
            raise DomainError.invalid(f"{what} lacks {name}")
    extra = sorted(key for key in value if key not in fields)
    if extra:
        raise DomainError.invalid(f"{what} has the unknown field {short(extra[0])}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise DomainError.invalid(f"{what} must be a list; got {short(value)}")
    return value


def _named(value: Any, expected: str, what: str) -> None:
    if value != expected:
        raise DomainError.invalid(f"{what} must be {expected}; got {short(value)}")


def _rational(value: Any, what: str) -> None:
    try:
        RationalNs.from_json(value, what)
    except DomainError as exc:
        message = exc.message if exc.message.startswith(what) else f"{what}: {exc.message}"
        raise DomainError.invalid(message) from None


def _check_agents(agents: list[Any]) -> list[str]:
    ids: list[str] = []
    for index, item in enumerate(agents):
        what = f"agents[{index}]"
        entry = _object(item, _AGENT_FIELDS, what)
        agent_id = parse_id(entry["agentId"], f"{what}.agentId")
        for name in ("profileDigest", "datasetDigest", "indexDigest"):
            parse_digest(entry[name], f"{what}.{name}")
        parse_id(entry["modelVersion"], f"{what}.modelVersion")
        parse_id(entry["plasticityVersion"], f"{what}.plasticityVersion")
        parse_i32(entry["seed"], f"{what}.seed")
        parse_u64(entry["brainTicks"], f"{what}.brainTicks")
        _rational(entry["remainder"], f"{what}.remainder")
        _named(entry["payload"], f"agent-{agent_id}", f"{what}.payload")
        if ids and agent_id <= ids[-1]:
            raise DomainError.invalid(f"agents are not strictly sorted by agentId: {agent_id} "
                                      f"follows {ids[-1]}")
        ids.append(agent_id)
    return ids


def _check_coordinator(value: Any, agent_ids: list[str], step: int) -> None:
    coordinator = _object(value, _COORDINATOR_FIELDS, "coordinator")
    _named(coordinator["taskLedger"], TASK_LEDGER, "coordinator.taskLedger")
    _named(coordinator["priorInspection"], PRIOR_INSPECTION, "coordinator.priorInspection")
    _named(coordinator["admissionState"], COORDINATOR_ADMISSION, "coordinator.admissionState")
    executors = _list(coordinator["executorState"], "coordinator.executorState")
    listed: list[str] = []
    for index, item in enumerate(executors):
        what = f"coordinator.executorState[{index}]"
        executor = _object(item, ("agentId", "payload"), what)
        agent_id = parse_id(executor["agentId"], f"{what}.agentId")
        _named(executor["payload"], f"executor-{agent_id}", f"{what}.payload")
        listed.append(agent_id)
    if listed != agent_ids:
        raise DomainError.invalid(f"coordinator.executorState lists {listed}; the agents are "
                                  f"{agent_ids}")
    marks = _object(coordinator["eventWatermarks"], ("lastSourceStep", "issued"),
                    "coordinator.eventWatermarks")
    last = parse_u64(marks["lastSourceStep"], "coordinator.eventWatermarks.lastSourceStep")
    parse_u64(marks["issued"], "coordinator.eventWatermarks.issued")
    if last > step:
        raise DomainError.invalid(f"eventWatermarks.lastSourceStep {last} is above the "
                                  f"source step {step}")


def payload_names(agent_ids: Sequence[str], helper_state: Sequence[str] = ()) -> list[str]:
    """The design/state.md §2.5 write order for these agents (sorted) and helper payloads."""
    return ([WORLD_PAYLOAD] + [f"agent-{a}" for a in agent_ids]
            + [f"executor-{a}" for a in agent_ids]
            + [TASK_LEDGER, PRIOR_INSPECTION, COORDINATOR_ADMISSION] + list(helper_state))


def _check_references(names: list[str], table: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise DomainError.invalid(f"payload {name} is referenced twice")
        seen.add(name)
    present = set(table)
    for name in names:
        if name not in present:
            raise DomainError.invalid(f"dangling reference: payload {name} is not in the table")
    for name in table:
        if name not in seen:
            raise DomainError.invalid(f"payload {name} is in the table but nothing references it")
    if names != table:
        raise DomainError.invalid(f"the payloads are not in write order (design/state.md §2.5): "
                                  f"{table} should "
                                  f"be {names}")


def _check_values(manifest: dict[str, Any]) -> None:
    parse_id(manifest["checkpointId"], "checkpointId")
    scope = Scope.from_json(manifest["sourceScope"], "sourceScope")
    parse_id(manifest["episodeId"], "episodeId")
    _rational(manifest["worldTime"], "worldTime")
    _named(manifest["schedulerId"], SCHEDULER_ID, "schedulerId")
    parse_digest(manifest["compositionDigest"], "compositionDigest")
    ports: list[str] = []
    port_agents: set[str] = set()
    for index, item in enumerate(_list(manifest["portMap"], "portMap")):
        what = f"portMap[{index}]"
        entry = _object(item, ("portId", "agentId"), what)
        port = parse_id(entry["portId"], f"{what}.portId")
        if port in ports:
            raise DomainError.invalid(f"portMap names port {port} twice")
        ports.append(port)
        port_agents.add(parse_id(entry["agentId"], f"{what}.agentId"))
    Compatibility.from_json(manifest["compatibility"])
    agent_ids = _check_agents(_list(manifest["agents"], "agents"))
    environment = _object(manifest["environment"], ("workerId", "payload"), "environment")
    parse_id(environment["workerId"], "environment.workerId")
    _named(environment["payload"], WORLD_PAYLOAD, "environment.payload")
    helpers = [parse_id(item, f"helperState[{index}]")
               for index, item in enumerate(_list(manifest["helperState"], "helperState"))]
    _check_coordinator(manifest["coordinator"], agent_ids, scope.step)
    table: list[str] = []
    for index, item in enumerate(_list(manifest["payloads"], "payloads")):
        what = f"payloads[{index}]"
        listing = _object(item, ("name", "byteLength", "digest"), what)
        table.append(parse_id(listing["name"], f"{what}.name"))
        parse_u64(listing["byteLength"], f"{what}.byteLength")
        parse_digest(listing["digest"], f"{what}.digest")
    if port_agents != set(agent_ids):
        raise DomainError.invalid(f"portMap binds agents {sorted(port_agents)}; the manifest "
                                  f"lists {agent_ids}")
    _check_references(payload_names(agent_ids, helpers), table)


def validate_manifest(manifest: Any) -> None:
    """R7's closed field set and envelopeVersion, then R8 (the values of design/state.md §2.4)."""
    checked = _check_fields(manifest)
    try:
        _check_values(checked)
    except DomainError as exc:
        raise EnvelopeError("R8", exc.message) from None


def decode(data: bytes | bytearray | memoryview) -> Envelope:
    """Read an envelope: R1–R8 in order; the first failure raises `EnvelopeError`."""
    layout = unpack(data)
    manifest = _check_fields(layout.manifest)
    _check_listing(manifest, layout.entries)
    validate_manifest(manifest)
    return Envelope(layout, manifest)


# --------------------------------------------------------------------------------------------
# Encoding


def _float_path(value: Any, path: str) -> str | None:
    if isinstance(value, float):
        return path
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _float_path(item, f"{path}.{key}")
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _float_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def encode(manifest: Mapping[str, Any], payloads: Sequence[tuple[str, bytes]]) -> bytes:
    """The one byte string for this manifest and payload list; `INTERNAL` for a caller bug.

    The manifest may hold values with `to_json()` (`Scope`, `RationalNs`); its `payloads`
    field must already list the payloads (names, lengths, digests, order)."""
    _check_names(payloads)
    found = _float_path(manifest, "manifest")
    if found is not None:
        raise _internal(f"{found} is a float; a manifest holds no floats")
    try:
        doc = plain(manifest)
    except DomainError as exc:
        raise _internal(f"the manifest is not JSON: {exc.message}") from None
    try:
        validate_manifest(doc)
    except EnvelopeError as exc:
        raise _internal(f"the manifest fails {exc.check}: {exc.reason}") from None
    listing = [{"name": name, "byteLength": str(len(body)), "digest": digest_bytes(body)}
               for name, body in payloads]
    if doc["payloads"] != listing:
        raise _internal("the manifest's payloads field differs from the payload list")
    return pack(canonical(doc), payloads)
