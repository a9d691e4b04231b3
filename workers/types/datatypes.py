"""Shared data types of the domain RPC (design/session.md §1.8) and media validation. Pure.

Agents, the environment and the coordinator exchange the same few shapes; parsing them in one
place means a worker and the coordinator refuse the same things with the same words.

Rules for every type here:
- `from_json(value, what)` refuses unknown and missing keys (optional means "present with
  null"), wrong types, out-of-range values and duplicates, with `INVALID_ARGUMENT`/`none` and a
  message that starts with the JSON path (`what`). `to_json()` is the exact inverse: U64 fields
  are Python ints and travel as decimal strings; plain integers stay JSON integers.
- Instances are frozen; lists become tuples. Direct construction is not re-validated beyond
  what a field's own type enforces (`RationalNs`, `Scope`), except `TypedValue`, whose 32 KiB
  canonical bound and JSON-ness are checked on construction (every `TypedValue` on the wire
  obeys it, whoever built it).
- Media (`decode_media`, `decode_view`, `decode_audio`): standard base64 with padding (strict:
  it must re-encode to the same text), decoded length = `byteLength`, SHA-256 = `digest`; or,
  by reference (`ArtifactBlob`, topics.md §14.2), an attachment of the frame with the same
  `artifactId`, `length` = `byteLength` and `digest` = `digest`, its bytes not hashed again (the
  router checked the digest once, at seal),
  content type `image/x-rgba8` (views) or `audio/x-f32le` (audio), a view's length =
  `rowStride·height`, an audio chunk's `byteLength = sampleFrames·channels·4` with every sample
  finite. Any failure is `BUFFER_INVALID` naming the view or stream; the mutation is the
  caller's (`none` at a worker, `unknown` in the coordinator's Phase C).
- Controls (`check_port_control`, `check_controls`): exactly one control per descriptor port,
  in descriptor order; each lists exactly the declared buttons then axes, in declared order;
  axis values finite and inside their range (bipolar [-1, 1], unipolar [0, 1]), never clamped;
  refusals are `INVALID_ARGUMENT` naming the port.

Resolved ambiguities (the spec lists fields and ranges, not these):
- Ids inside one list are unique: `ports[].portId`, `views[].viewId`, `audio[].streamId`,
  `rates[].roleId`, controller `buttons` and `axes[].id`, `rateRoles`, `supportedStimuli`,
  `sensoryViews[].viewId`, `broadcastViews`, `audio[].streamId`.
- `broadcastViews` may only name views present in `sensoryViews`.
- A controller axis's `neutral` lies inside its range; a descriptor's `stepDuration` is > 0.
- `Telemetry.rates` order is checked against a graph by `Telemetry.check_rates(graph)`: role ids
  must be graph `rateRoles`, in that order (a subsequence).
- `MediaBlob.contentType` is any string at parse time; the expected type is checked when the
  media is decoded (that is a `BUFFER_INVALID`, not an `INVALID_ARGUMENT`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

import orjson

from workers.types.canonical import canonical, canonical_size, plain, typed_canonical
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    format_u64,
    parse_bool,
    parse_digest,
    parse_finite,
    parse_id,
    parse_int,
    parse_string,
    parse_u64,
    short,
)
from workers.types.ticks import RationalNs

__all__ = [
    "ARRAY_CONTENT_TYPE",
    "AUDIO_CONTENT_TYPE",
    "AUDIO_FORMAT",
    "MAX_ARRAYS",
    "MAX_TYPED_VALUE_BYTES",
    "VIEW_CONTENT_TYPE",
    "VIEW_FORMAT",
    "AgentInput",
    "ArrayValue",
    "ArtifactBlob",
    "AssetRef",
    "Attached",
    "AudioDescriptor",
    "AudioRef",
    "AxisSpec",
    "AxisValue",
    "ButtonState",
    "ControllerSchema",
    "EnvironmentDescriptor",
    "Graph",
    "Learning",
    "MediaBlob",
    "MediaValue",
    "PixelAspect",
    "PortControl",
    "PortSpec",
    "RateRole",
    "Reward",
    "SchemaRef",
    "SensoryInput",
    "Stimulus",
    "Telemetry",
    "TypedValue",
    "ViewDescriptor",
    "ViewRef",
    "WorldObservation",
    "check_controls",
    "check_port_control",
    "decode_array",
    "decode_audio",
    "decode_media",
    "decode_view",
    "encode_media",
    "inline_media",
    "parse_media",
]

MAX_TYPED_VALUE_BYTES: Final = 32 * 1024
VIEW_FORMAT: Final = "rgba8"
VIEW_CONTENT_TYPE: Final = "image/x-rgba8"
AUDIO_FORMAT: Final = "f32le-interleaved"
AUDIO_CONTENT_TYPE: Final = "audio/x-f32le"
#: a numeric array's bytes: C order, in the byte order and item size its `dtype` names
ARRAY_CONTENT_TYPE: Final = "application/x-flyd-array"
#: arrays per agent input (a `Dict`/`Tuple` observation of that many numeric leaves)
MAX_ARRAYS: Final = 64
#: agent inputs of one observation (the most agents a run binds)
MAX_AGENT_INPUTS: Final = 256
#: numpy's dtype strings of fixed-size numbers: byte order, kind (bool, int, uint, float),
#: item size
_DTYPE: Final = re.compile(r"[<>|](b1|[iu](1|2|4|8)|f(2|4|8))")
AXIS_RANGES: Final[dict[str, tuple[float, float]]] = {
    "bipolar": (-1.0, 1.0),
    "unipolar": (0.0, 1.0),
}

AxisRange = Literal["bipolar", "unipolar"]
Recovery = Literal["exact-checkpoint", "none"]
Determinism = Literal["fixed-build", "none"]


# --------------------------------------------------------------------------------------------
# parsing helpers


def _object(value: Any, keys: Sequence[str], what: str) -> dict[str, Any]:
    if type(value) is dict and len(value) == len(keys) and all(map(value.__contains__, keys)):
        return value  # exactly the keys (the common case, tested without building sets)
    if not isinstance(value, dict):
        raise DomainError.invalid(f"{what} must be an object; got {short(value)}")
    missing = [key for key in keys if key not in value]
    if missing:
        raise DomainError.invalid(f"{what} is missing {', '.join(missing)}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise DomainError.invalid(f"{what} has unknown key(s) {', '.join(map(repr, unknown))}")
    return value


def _list(value: Any, what: str, max_items: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise DomainError.invalid(f"{what} must be a list; got {short(value)}")
    if max_items is not None and len(value) > max_items:
        raise DomainError.invalid(f"{what} has {len(value)} items; at most {max_items}")
    return value


def _unique(ids: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for item in ids:
        if item in seen:
            raise DomainError.invalid(f"{what} lists {item} twice")
        seen.add(item)


def _ids(value: Any, what: str, max_items: int | None = None) -> tuple[str, ...]:
    items = tuple(
        parse_id(item, f"{what}[{i}]") for i, item in enumerate(_list(value, what, max_items))
    )
    _unique(items, what)
    return items


def _choice(value: Any, choices: Sequence[str], what: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise DomainError.invalid(f"{what} must be one of {', '.join(choices)}; got {short(value)}")
    return value


def _non_negative(value: Any, what: str) -> float:
    number = parse_finite(value, what)
    if number < 0:
        raise DomainError.invalid(f"{what} must be >= 0; got {number}")
    return number


# --------------------------------------------------------------------------------------------
# schema references and typed values


@dataclass(frozen=True, slots=True)
class SchemaRef:
    id: str
    version: int
    digest: str

    @classmethod
    def from_json(cls, value: Any, what: str = "schema") -> SchemaRef:
        v = _object(value, ("id", "version", "digest"), what)
        return cls(
            parse_id(v["id"], f"{what}.id"),
            parse_int(v["version"], f"{what}.version", 1, 65535),
            parse_digest(v["digest"], f"{what}.digest"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "version": self.version, "digest": self.digest}


# The canonical bytes of the schema references TypedValues were built with: a process uses a
# handful, each in several values a step. Bounded, in case a peer sends ever new ones.
_SCHEMA_BYTES: dict[SchemaRef, bytes] = {}
_SCHEMA_BYTES_MAX: Final = 256


def _schema_bytes(schema: SchemaRef) -> bytes:
    """`canonical(schema)`, remembered for a well-typed reference (a reference equal to one
    seen before has the same fields, so the same bytes; a `bool` version, equal to 1 but
    written `true`, is never remembered)."""
    if type(schema) is not SchemaRef or type(schema.version) is not int \
            or type(schema.id) is not str or type(schema.digest) is not str:
        return canonical(schema)
    data = _SCHEMA_BYTES.get(schema)
    if data is None:
        data = canonical(schema)
        if len(_SCHEMA_BYTES) < _SCHEMA_BYTES_MAX:
            _SCHEMA_BYTES[schema] = data
    return data


@dataclass(frozen=True, slots=True)
class TypedValue:
    """A JSON value tagged with its schema; at most 32 KiB of canonical JSON.

    The canonical bytes of `{schema, value}` are computed once, on construction (the size
    bound needs them anyway), and kept: `typed_digest` hashes them and `to_json` reads the
    value back from them, so a value that crosses a step several times (a decision, a
    context) is written canonically once. The value is never mutated after construction."""

    schema: SchemaRef
    value: Any
    _canonical: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            # = canonical(self) without `plain`'s round trip: canonical(plain(v)) is
            # canonical(v) whenever plain(v) succeeds; the schema's bytes are remembered
            data = typed_canonical(_schema_bytes(self.schema), self.value)
        except Exception:
            canonical_size(self)  # raises the refusal exactly as canonical_size words it
            raise
        if len(data) > MAX_TYPED_VALUE_BYTES:
            raise DomainError.invalid(
                f"a TypedValue of schema {self.schema.id} has {len(data)} canonical bytes; "
                f"at most {MAX_TYPED_VALUE_BYTES}"
            )
        object.__setattr__(self, "_canonical", data)

    def canonical_bytes(self) -> bytes:
        """`canonical({"schema": schema, "value": value})`, as computed on construction."""
        return self._canonical

    @classmethod
    def from_json(cls, value: Any, what: str = "typedValue") -> TypedValue:
        v = _object(value, ("schema", "value"), what)
        try:
            return cls(SchemaRef.from_json(v["schema"], f"{what}.schema"), v["value"])
        except DomainError as exc:
            if exc.message.startswith(what):
                raise
            raise exc.with_message(f"{what}: {exc.message}") from None

    def to_json(self) -> dict[str, Any]:
        cached: bytes | None = getattr(self, "_canonical", None)  # unset while refusing
        if cached is None:
            return {"schema": self.schema.to_json(), "value": plain(self.value)}
        # canonical integers stay within ±(2^53-1), so orjson reads them back exactly
        return {"schema": self.schema.to_json(), "value": orjson.loads(cached)["value"]}


@dataclass(frozen=True, slots=True)
class AssetRef:
    id: str
    digest: str
    byte_length: int
    format: str

    @classmethod
    def from_json(cls, value: Any, what: str = "asset") -> AssetRef:
        v = _object(value, ("id", "digest", "byteLength", "format"), what)
        return cls(
            parse_id(v["id"], f"{what}.id"),
            parse_digest(v["digest"], f"{what}.digest"),
            parse_u64(v["byteLength"], f"{what}.byteLength"),
            parse_id(v["format"], f"{what}.format"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "digest": self.digest,
            "byteLength": format_u64(self.byte_length),
            "format": self.format,
        }


# --------------------------------------------------------------------------------------------
# media


@dataclass(frozen=True, slots=True)
class MediaBlob:
    """Inline media (v1): base64 `data` of exactly `byteLength` bytes hashing to `digest`."""

    content_type: str
    byte_length: int
    digest: str
    data: str

    @classmethod
    def from_json(cls, value: Any, what: str = "media") -> MediaBlob:
        v = _object(value, ("contentType", "byteLength", "digest", "data"), what)
        return cls(
            parse_string(v["contentType"], f"{what}.contentType"),
            parse_u64(v["byteLength"], f"{what}.byteLength"),
            parse_digest(v["digest"], f"{what}.digest"),
            parse_string(v["data"], f"{what}.data"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "contentType": self.content_type,
            "byteLength": format_u64(self.byte_length),
            "digest": self.digest,
            "data": self.data,
        }


@dataclass(frozen=True, slots=True)
class ArtifactBlob:
    """Media by reference (topics.md §14.2): the bytes are the sealed artifact
    `artifactId` attached to the same frame. A second key set rather than a nullable member of
    `MediaBlob`, so inline frames stay byte-identical."""

    content_type: str
    byte_length: int
    digest: str
    artifact_id: str

    def to_json(self) -> dict[str, Any]:
        return {
            "contentType": self.content_type,
            "byteLength": format_u64(self.byte_length),
            "digest": self.digest,
            "artifactId": self.artifact_id,
        }


MediaValue = MediaBlob | ArtifactBlob

_INLINE_KEYS: Final = ("contentType", "byteLength", "digest", "data")
_REFERENCE_KEYS: Final = ("contentType", "byteLength", "digest", "artifactId")


def parse_media(value: Any, what: str = "media") -> MediaValue:
    """Either key set: `artifactId` present means by reference, else inline (`MediaBlob`)."""
    if not isinstance(value, dict) or "artifactId" not in value:
        return MediaBlob.from_json(value, what)
    v = _object(value, _REFERENCE_KEYS, what)
    return ArtifactBlob(
        parse_string(v["contentType"], f"{what}.contentType"),
        parse_u64(v["byteLength"], f"{what}.byteLength"),
        parse_digest(v["digest"], f"{what}.digest"),
        parse_string(v["artifactId"], f"{what}.artifactId"),
    )


@dataclass(frozen=True, slots=True)
class Attached:
    """One attachment of a received frame, opened: its sealed length and digest as the router
    reported them, and a read-only view of its bytes (or None when it could not be opened)."""

    length: int
    digest: str
    data: memoryview | None


def encode_media(content_type: str, data: bytes) -> MediaBlob:
    return inline_media(content_type, data, hashlib.sha256(data).hexdigest())


def inline_media(content_type: str, data: bytes, digest: str) -> MediaBlob:
    """Inline media whose digest the caller already computed (a by-reference blob that fell
    back to inline keeps the digest it was staged with)."""
    return MediaBlob(content_type, len(data), digest, base64.b64encode(data).decode("ascii"))


def _buffer_invalid(message: str, mutation: Mutation | str) -> DomainError:
    return DomainError(ErrorCode.BUFFER_INVALID, message, mutation)


def _canonical_base64(text: str, data: bytes) -> bool:
    """Whether `text`, which strict base64 decoding turned into `data`, is exactly
    `b64encode(data)`. Strict decoding already refuses foreign characters and anything after
    the padding, so every 4-character group before the last maps one to one onto 3 bytes: only
    the last group can differ (unused bits set, padding missing), and re-encoding its bytes
    alone decides, instead of re-encoding a whole frame."""
    if not data:
        return text == ""
    last = len(data) % 3 or 3
    return len(text) % 4 == 0 and \
        base64.b64encode(data[-last:]) == text[-4:].encode("ascii")


def decode_media(
    blob: MediaValue, content_type: str, name: str, mutation: Mutation | str = Mutation.NONE,
    attached: Mapping[str, Attached] | None = None,
) -> bytes:
    """The blob's bytes after every check of design/session.md §1.8; `name` is "view <id>" or "audio
    stream <id>"; `attached`: the frame's attachments by artifact id (a by-reference blob needs
    one)."""
    if blob.content_type != content_type:
        raise _buffer_invalid(
            f"{name} has content type {short(blob.content_type)}; expected {content_type}",
            mutation,
        )
    if isinstance(blob, ArtifactBlob):
        return _referenced(blob, name, mutation, attached or {})
    try:
        # what `base64.b64decode(validate=True)` does, without its copy of the text to bytes
        data = binascii.a2b_base64(blob.data, strict_mode=True)
    except (binascii.Error, ValueError):
        raise _buffer_invalid(f"{name} is not valid base64", mutation) from None
    if not _canonical_base64(blob.data, data):
        raise _buffer_invalid(f"{name} is not canonical padded base64", mutation)
    if len(data) != blob.byte_length:
        raise _buffer_invalid(
            f"{name} decodes to {len(data)} bytes; byteLength says {blob.byte_length}", mutation
        )
    if hashlib.sha256(data).hexdigest() != blob.digest:
        raise _buffer_invalid(f"{name} does not match its digest", mutation)
    return data


def _referenced(blob: ArtifactBlob, name: str, mutation: Mutation | str,
                attached: Mapping[str, Attached]) -> bytes:
    """topics.md §14.2 rule 4: the attachment must be the one the blob names, of its length
    and digest; the router hashed it at seal, so the bytes are only copied."""
    found = attached.get(blob.artifact_id)
    if found is None:
        raise _buffer_invalid(f"{name} names artifact {short(blob.artifact_id)}, which the frame "
                              "does not attach", mutation)
    if found.length != blob.byte_length:
        raise _buffer_invalid(f"{name}'s artifact has {found.length} bytes; byteLength says "
                              f"{blob.byte_length}", mutation)
    if found.digest != blob.digest:
        raise _buffer_invalid(f"{name}'s artifact does not match its digest", mutation)
    if found.data is None or len(found.data) != blob.byte_length:
        raise _buffer_invalid(f"{name}'s artifact could not be opened", mutation)
    whole = found.data.obj
    # a frame-sized artifact was read into immutable bytes already: no second copy
    return whole if type(whole) is bytes and len(whole) == blob.byte_length \
        else bytes(found.data)


@dataclass(frozen=True, slots=True)
class PixelAspect:
    numerator: int
    denominator: int

    @classmethod
    def from_json(cls, value: Any, what: str = "pixelAspect") -> PixelAspect:
        v = _object(value, ("numerator", "denominator"), what)
        return cls(
            parse_int(v["numerator"], f"{what}.numerator", 1, 65535),
            parse_int(v["denominator"], f"{what}.denominator", 1, 65535),
        )

    def to_json(self) -> dict[str, Any]:
        return {"numerator": self.numerator, "denominator": self.denominator}


@dataclass(frozen=True, slots=True)
class ViewDescriptor:
    view_id: str
    width: int
    height: int
    row_stride: int
    pixel_aspect: PixelAspect
    observation_delay_steps: int
    format: str = VIEW_FORMAT

    @classmethod
    def from_json(cls, value: Any, what: str = "view") -> ViewDescriptor:
        keys = ("viewId", "width", "height", "format", "rowStride", "pixelAspect",
                "observationDelaySteps")
        v = _object(value, keys, what)
        width = parse_int(v["width"], f"{what}.width", 1, 4096)
        _choice(v["format"], (VIEW_FORMAT,), f"{what}.format")
        row_stride = parse_int(v["rowStride"], f"{what}.rowStride", 4 * width, 4 * width)
        return cls(
            view_id=parse_id(v["viewId"], f"{what}.viewId"),
            width=width,
            height=parse_int(v["height"], f"{what}.height", 1, 4096),
            row_stride=row_stride,
            pixel_aspect=PixelAspect.from_json(v["pixelAspect"], f"{what}.pixelAspect"),
            observation_delay_steps=parse_int(
                v["observationDelaySteps"], f"{what}.observationDelaySteps", 0, 8
            ),
        )

    @property
    def byte_length(self) -> int:
        return self.row_stride * self.height

    def produced_step(self, boundary: int) -> int:
        """The step whose frame is served at `boundary`: `max(0, boundary − delay)`."""
        return max(0, boundary - self.observation_delay_steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "viewId": self.view_id,
            "width": self.width,
            "height": self.height,
            "format": self.format,
            "rowStride": self.row_stride,
            "pixelAspect": self.pixel_aspect.to_json(),
            "observationDelaySteps": self.observation_delay_steps,
        }


@dataclass(frozen=True, slots=True)
class ViewRef:
    view_id: str
    produced_step: int
    pixels: MediaValue

    @classmethod
    def from_json(cls, value: Any, what: str = "view") -> ViewRef:
        v = _object(value, ("viewId", "producedStep", "pixels"), what)
        return cls(
            parse_id(v["viewId"], f"{what}.viewId"),
            parse_u64(v["producedStep"], f"{what}.producedStep"),
            parse_media(v["pixels"], f"{what}.pixels"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "viewId": self.view_id,
            "producedStep": format_u64(self.produced_step),
            "pixels": self.pixels.to_json(),
        }


def decode_view(
    ref: ViewRef, descriptor: ViewDescriptor, mutation: Mutation | str = Mutation.NONE,
    attached: Mapping[str, Attached] | None = None,
) -> bytes:
    """A view's RGBA8 bytes (top-left origin, no row padding), checked against its descriptor."""
    name = f"view {ref.view_id}"
    if ref.view_id != descriptor.view_id:
        raise _buffer_invalid(f"{name} is not the declared view {descriptor.view_id}", mutation)
    data = decode_media(ref.pixels, VIEW_CONTENT_TYPE, name, mutation, attached)
    if len(data) != descriptor.byte_length:
        raise _buffer_invalid(
            f"{name} has {len(data)} bytes; the descriptor requires {descriptor.byte_length}",
            mutation,
        )
    return data


@dataclass(frozen=True, slots=True)
class AudioDescriptor:
    stream_id: str
    sample_rate: int
    channels: int
    format: str = AUDIO_FORMAT

    @classmethod
    def from_json(cls, value: Any, what: str = "audio") -> AudioDescriptor:
        v = _object(value, ("streamId", "sampleRate", "channels", "format"), what)
        _choice(v["format"], (AUDIO_FORMAT,), f"{what}.format")
        return cls(
            parse_id(v["streamId"], f"{what}.streamId"),
            parse_int(v["sampleRate"], f"{what}.sampleRate", 8000, 192000),
            parse_int(v["channels"], f"{what}.channels", 1, 8),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "streamId": self.stream_id,
            "sampleRate": self.sample_rate,
            "channels": self.channels,
            "format": self.format,
        }


@dataclass(frozen=True, slots=True)
class AudioRef:
    stream_id: str
    first_sample: int
    sample_frames: int
    samples: MediaValue
    discontinuity: bool

    @classmethod
    def from_json(cls, value: Any, what: str = "audio") -> AudioRef:
        keys = ("streamId", "firstSample", "sampleFrames", "samples", "discontinuity")
        v = _object(value, keys, what)
        return cls(
            parse_id(v["streamId"], f"{what}.streamId"),
            parse_u64(v["firstSample"], f"{what}.firstSample"),
            parse_int(v["sampleFrames"], f"{what}.sampleFrames", 0, 192000),
            parse_media(v["samples"], f"{what}.samples"),
            parse_bool(v["discontinuity"], f"{what}.discontinuity"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "streamId": self.stream_id,
            "firstSample": format_u64(self.first_sample),
            "sampleFrames": self.sample_frames,
            "samples": self.samples.to_json(),
            "discontinuity": self.discontinuity,
        }


def decode_audio(
    ref: AudioRef, descriptor: AudioDescriptor, mutation: Mutation | str = Mutation.NONE,
    attached: Mapping[str, Attached] | None = None,
) -> bytes:
    """A chunk's interleaved f32le bytes, checked for size and finiteness."""
    name = f"audio stream {ref.stream_id}"
    if ref.stream_id != descriptor.stream_id:
        raise _buffer_invalid(
            f"{name} is not the declared stream {descriptor.stream_id}", mutation
        )
    expected = ref.sample_frames * descriptor.channels * 4
    if ref.samples.byte_length != expected:
        raise _buffer_invalid(
            f"{name} has byteLength {ref.samples.byte_length}; {ref.sample_frames} frames of "
            f"{descriptor.channels} channels need {expected}",
            mutation,
        )
    data = decode_media(ref.samples, AUDIO_CONTENT_TYPE, name, mutation, attached)
    samples = array("f")
    samples.frombytes(data)
    if sys.byteorder != "little":
        samples.byteswap()
    # Finite float32 magnitudes are below 2^128, so every partial double sum of finite samples
    # stays far below the double range (n·2^128, n < 2^64); an inf or a NaN sample makes the sum
    # inf or NaN (inf + -inf is NaN). So the sum is finite exactly when every sample is.
    if not math.isfinite(sum(samples)):
        raise _buffer_invalid(f"{name} holds a sample that is not finite", mutation)
    return data


@dataclass(frozen=True, slots=True)
class ArrayValue:
    """A numeric array as binary (docs/adapters.md): `dtype` (numpy's dtype string, byte order
    first), `shape`, and the C-order bytes as media (`ARRAY_CONTENT_TYPE`, inline base64 or by
    reference), digested over those bytes. `id` names it inside its input's structured value."""

    id: str
    dtype: str
    shape: tuple[int, ...]
    bytes: MediaValue

    @classmethod
    def from_json(cls, value: Any, what: str = "array") -> ArrayValue:
        v = _object(value, ("id", "dtype", "shape", "bytes"), what)
        dtype = parse_string(v["dtype"], f"{what}.dtype")
        if _DTYPE.fullmatch(dtype) is None:
            raise DomainError.invalid(f"{what}.dtype {short(dtype)} is not a numeric dtype "
                                      "(<f4, |u1, <i8, |b1, ...)")
        shape = tuple(parse_int(n, f"{what}.shape[{i}]", 0, 2**31 - 1)
                      for i, n in enumerate(_list(v["shape"], f"{what}.shape", 8)))
        return cls(parse_id(v["id"], f"{what}.id"), dtype, shape,
                   parse_media(v["bytes"], f"{what}.bytes"))

    def byte_length(self) -> int:
        """What the bytes must measure: item size times the elements."""
        return int(self.dtype[2:]) * math.prod(self.shape)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "dtype": self.dtype, "shape": list(self.shape),
                "bytes": self.bytes.to_json()}


def decode_array(array_value: ArrayValue, mutation: Mutation | str = Mutation.NONE,
                 attached: Mapping[str, Attached] | None = None) -> bytes:
    """The array's bytes after the media checks, of exactly `byte_length()` bytes."""
    name = f"array {array_value.id}"
    data = decode_media(array_value.bytes, ARRAY_CONTENT_TYPE, name, mutation, attached)
    if len(data) != array_value.byte_length():
        raise _buffer_invalid(f"{name} has {len(data)} bytes; {array_value.dtype} of shape "
                              f"{list(array_value.shape)} needs {array_value.byte_length()}",
                              mutation)
    return data


def _arrays(value: Any, what: str) -> tuple[ArrayValue, ...]:
    arrays = tuple(ArrayValue.from_json(item, f"{what}[{i}]")
                   for i, item in enumerate(_list(value, what, MAX_ARRAYS)))
    _unique([a.id for a in arrays], what)
    return arrays


@dataclass(frozen=True, slots=True)
class SensoryInput:
    """An agent's input of a boundary. `arrays` (the binary arrays its structured value names)
    travels only when there are some: an input without arrays is byte-identical to v1's."""

    boundary: int
    views: tuple[ViewRef, ...]
    structured: TypedValue | None
    arrays: tuple[ArrayValue, ...] = ()

    @classmethod
    def from_json(cls, value: Any, what: str = "input") -> SensoryInput:
        keys = ("boundary", "views", "structured")
        v = _object(value, (*keys, "arrays") if isinstance(value, dict) and "arrays" in value
                    else keys, what)
        views = tuple(
            ViewRef.from_json(item, f"{what}.views[{i}]")
            for i, item in enumerate(_list(v["views"], f"{what}.views", 8))
        )
        _unique([view.view_id for view in views], f"{what}.views")
        structured = v["structured"]
        return cls(
            parse_u64(v["boundary"], f"{what}.boundary"),
            views,
            None if structured is None else TypedValue.from_json(structured, f"{what}.structured"),
            _arrays(v["arrays"], f"{what}.arrays") if "arrays" in v else (),
        )

    def to_json(self) -> dict[str, Any]:
        doc = {
            "boundary": format_u64(self.boundary),
            "views": [view.to_json() for view in self.views],
            "structured": None if self.structured is None else self.structured.to_json(),
        }
        if self.arrays:
            doc["arrays"] = [a.to_json() for a in self.arrays]
        return doc


@dataclass(frozen=True, slots=True)
class AgentInput:
    """What a world with per-agent inputs gives the agent on one port: its own structured value
    and the arrays it names (`workers.protocols.PER_AGENT_INPUT`)."""

    port_id: str
    structured: TypedValue | None
    arrays: tuple[ArrayValue, ...]

    @classmethod
    def from_json(cls, value: Any, what: str = "agentInput") -> AgentInput:
        v = _object(value, ("portId", "structured", "arrays"), what)
        structured = v["structured"]
        return cls(parse_id(v["portId"], f"{what}.portId"),
                   None if structured is None else
                   TypedValue.from_json(structured, f"{what}.structured"),
                   _arrays(v["arrays"], f"{what}.arrays"))

    def to_json(self) -> dict[str, Any]:
        return {"portId": self.port_id,
                "structured": None if self.structured is None else self.structured.to_json(),
                "arrays": [a.to_json() for a in self.arrays]}


# --------------------------------------------------------------------------------------------
# agent-side values


@dataclass(frozen=True, slots=True)
class Stimulus:
    id: str
    kind_id: str
    duration_ms: float

    @classmethod
    def from_json(cls, value: Any, what: str = "stimulus") -> Stimulus:
        v = _object(value, ("id", "kindId", "durationMs"), what)
        duration = parse_finite(v["durationMs"], f"{what}.durationMs")
        if duration <= 0:
            raise DomainError.invalid(f"{what}.durationMs must be > 0; got {duration}")
        return cls(parse_id(v["id"], f"{what}.id"), parse_id(v["kindId"], f"{what}.kindId"),
                   duration)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kindId": self.kind_id, "durationMs": self.duration_ms}


@dataclass(frozen=True, slots=True)
class Reward:
    event_id: str
    rule_id: str
    value: float

    @classmethod
    def from_json(cls, value: Any, what: str = "reward") -> Reward:
        v = _object(value, ("eventId", "ruleId", "value"), what)
        return cls(
            parse_id(v["eventId"], f"{what}.eventId"),
            parse_id(v["ruleId"], f"{what}.ruleId"),
            parse_finite(v["value"], f"{what}.value"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"eventId": self.event_id, "ruleId": self.rule_id, "value": self.value}


@dataclass(frozen=True, slots=True)
class RateRole:
    role_id: str
    hz: float

    @classmethod
    def from_json(cls, value: Any, what: str = "rate") -> RateRole:
        v = _object(value, ("roleId", "hz"), what)
        return cls(parse_id(v["roleId"], f"{what}.roleId"), _non_negative(v["hz"], f"{what}.hz"))

    def to_json(self) -> dict[str, Any]:
        return {"roleId": self.role_id, "hz": self.hz}


@dataclass(frozen=True, slots=True)
class Learning:
    enabled: bool
    updates: int
    changed: int
    signal: float

    @classmethod
    def from_json(cls, value: Any, what: str = "learning") -> Learning:
        v = _object(value, ("enabled", "updates", "changed", "signal"), what)
        updates = parse_u64(v["updates"], f"{what}.updates")
        changed = parse_u64(v["changed"], f"{what}.changed")
        if changed > updates:
            raise DomainError.invalid(f"{what}.changed {changed} exceeds updates {updates}")
        return cls(
            parse_bool(v["enabled"], f"{what}.enabled"),
            updates,
            changed,
            parse_finite(v["signal"], f"{what}.signal"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "updates": format_u64(self.updates),
            "changed": format_u64(self.changed),
            "signal": self.signal,
        }


@dataclass(frozen=True, slots=True)
class Graph:
    dataset_digest: str
    index_digest: str
    neuron_count: int
    rate_roles: tuple[str, ...]
    supported_stimuli: tuple[str, ...]

    @classmethod
    def from_json(cls, value: Any, what: str = "graph") -> Graph:
        keys = ("datasetDigest", "indexDigest", "neuronCount", "rateRoles", "supportedStimuli")
        v = _object(value, keys, what)
        return cls(
            parse_digest(v["datasetDigest"], f"{what}.datasetDigest"),
            parse_digest(v["indexDigest"], f"{what}.indexDigest"),
            parse_u64(v["neuronCount"], f"{what}.neuronCount"),
            _ids(v["rateRoles"], f"{what}.rateRoles"),
            _ids(v["supportedStimuli"], f"{what}.supportedStimuli"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "datasetDigest": self.dataset_digest,
            "indexDigest": self.index_digest,
            "neuronCount": format_u64(self.neuron_count),
            "rateRoles": list(self.rate_roles),
            "supportedStimuli": list(self.supported_stimuli),
        }


@dataclass(frozen=True, slots=True)
class Telemetry:
    brain_ticks: int
    population_rate_hz: float
    rates: tuple[RateRole, ...]
    learning: Learning
    stimulus_remaining_ms: float | None

    @classmethod
    def from_json(cls, value: Any, what: str = "telemetry") -> Telemetry:
        keys = ("brainTicks", "populationRateHz", "rates", "learning", "stimulusRemainingMs")
        v = _object(value, keys, what)
        rates = tuple(
            RateRole.from_json(item, f"{what}.rates[{i}]")
            for i, item in enumerate(_list(v["rates"], f"{what}.rates", 64))
        )
        _unique([rate.role_id for rate in rates], f"{what}.rates")
        remaining = v["stimulusRemainingMs"]
        return cls(
            parse_u64(v["brainTicks"], f"{what}.brainTicks"),
            _non_negative(v["populationRateHz"], f"{what}.populationRateHz"),
            rates,
            Learning.from_json(v["learning"], f"{what}.learning"),
            None if remaining is None else _non_negative(remaining, f"{what}.stimulusRemainingMs"),
        )

    def check_rates(self, graph: Graph, what: str = "telemetry") -> None:
        """Rates name graph roles, in the graph's `rateRoles` order."""
        order = {role: index for index, role in enumerate(graph.rate_roles)}
        previous = -1
        for rate in self.rates:
            index = order.get(rate.role_id)
            if index is None:
                raise DomainError.invalid(f"{what}.rates names {rate.role_id}, not a graph role")
            if index <= previous:
                raise DomainError.invalid(f"{what}.rates are not in graph rateRoles order")
            previous = index

    def to_json(self) -> dict[str, Any]:
        return {
            "brainTicks": format_u64(self.brain_ticks),
            "populationRateHz": self.population_rate_hz,
            "rates": [rate.to_json() for rate in self.rates],
            "learning": self.learning.to_json(),
            "stimulusRemainingMs": self.stimulus_remaining_ms,
        }


# --------------------------------------------------------------------------------------------
# controllers and controls


@dataclass(frozen=True, slots=True)
class AxisSpec:
    id: str
    range: AxisRange
    neutral: float

    @classmethod
    def from_json(cls, value: Any, what: str = "axis") -> AxisSpec:
        v = _object(value, ("id", "range", "neutral"), what)
        axis_range = _choice(v["range"], tuple(AXIS_RANGES), f"{what}.range")
        neutral = parse_finite(v["neutral"], f"{what}.neutral")
        low, high = AXIS_RANGES[axis_range]
        if not low <= neutral <= high:
            raise DomainError.invalid(
                f"{what}.neutral {neutral} lies outside the {axis_range} range"
            )
        return cls(parse_id(v["id"], f"{what}.id"), cast(AxisRange, axis_range), neutral)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "range": self.range, "neutral": self.neutral}


@dataclass(frozen=True, slots=True)
class ControllerSchema:
    schema: SchemaRef
    buttons: tuple[str, ...]
    axes: tuple[AxisSpec, ...]

    @classmethod
    def from_json(cls, value: Any, what: str = "controls") -> ControllerSchema:
        v = _object(value, ("schema", "buttons", "axes"), what)
        axes = tuple(
            AxisSpec.from_json(item, f"{what}.axes[{i}]")
            for i, item in enumerate(_list(v["axes"], f"{what}.axes", 16))
        )
        _unique([axis.id for axis in axes], f"{what}.axes")
        return cls(
            SchemaRef.from_json(v["schema"], f"{what}.schema"),
            _ids(v["buttons"], f"{what}.buttons", 32),
            axes,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema.to_json(),
            "buttons": list(self.buttons),
            "axes": [axis.to_json() for axis in self.axes],
        }


@dataclass(frozen=True, slots=True)
class ButtonState:
    id: str
    down: bool

    @classmethod
    def from_json(cls, value: Any, what: str = "button") -> ButtonState:
        v = _object(value, ("id", "down"), what)
        return cls(parse_id(v["id"], f"{what}.id"), parse_bool(v["down"], f"{what}.down"))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "down": self.down}


@dataclass(frozen=True, slots=True)
class AxisValue:
    id: str
    value: float

    @classmethod
    def from_json(cls, value: Any, what: str = "axis") -> AxisValue:
        v = _object(value, ("id", "value"), what)
        return cls(parse_id(v["id"], f"{what}.id"), parse_finite(v["value"], f"{what}.value"))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "value": self.value}


@dataclass(frozen=True, slots=True)
class PortControl:
    port_id: str
    buttons: tuple[ButtonState, ...]
    axes: tuple[AxisValue, ...]

    @classmethod
    def from_json(cls, value: Any, what: str = "control") -> PortControl:
        v = _object(value, ("portId", "buttons", "axes"), what)
        return cls(
            parse_id(v["portId"], f"{what}.portId"),
            tuple(
                ButtonState.from_json(item, f"{what}.buttons[{i}]")
                for i, item in enumerate(_list(v["buttons"], f"{what}.buttons", 32))
            ),
            tuple(
                AxisValue.from_json(item, f"{what}.axes[{i}]")
                for i, item in enumerate(_list(v["axes"], f"{what}.axes", 16))
            ),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "portId": self.port_id,
            "buttons": [button.to_json() for button in self.buttons],
            "axes": [axis.to_json() for axis in self.axes],
        }


@dataclass(frozen=True, slots=True)
class PortSpec:
    port_id: str
    controls: ControllerSchema

    @classmethod
    def from_json(cls, value: Any, what: str = "port") -> PortSpec:
        v = _object(value, ("portId", "controls"), what)
        return cls(
            parse_id(v["portId"], f"{what}.portId"),
            ControllerSchema.from_json(v["controls"], f"{what}.controls"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"portId": self.port_id, "controls": self.controls.to_json()}


def check_port_control(control: PortControl, port: PortSpec) -> None:
    """The control lists exactly the port's buttons then axes, in order, values in range."""
    name = f"port {port.port_id}"
    if control.port_id != port.port_id:
        raise DomainError.invalid(f"{name}: the control names port {control.port_id}")
    buttons = tuple(button.id for button in control.buttons)
    if buttons != port.controls.buttons:
        raise DomainError.invalid(
            f"{name}: buttons {list(buttons)} must be exactly {list(port.controls.buttons)}"
        )
    axes = tuple(axis.id for axis in control.axes)
    declared = tuple(axis.id for axis in port.controls.axes)
    if axes != declared:
        raise DomainError.invalid(f"{name}: axes {list(axes)} must be exactly {list(declared)}")
    for axis, spec in zip(control.axes, port.controls.axes, strict=True):
        low, high = AXIS_RANGES[spec.range]
        if not math.isfinite(axis.value) or not low <= axis.value <= high:
            raise DomainError.invalid(
                f"{name}: axis {axis.id} value {axis.value} lies outside its {spec.range} "
                f"range [{low:g}, {high:g}]"
            )


def check_controls(controls: Sequence[PortControl], ports: Sequence[PortSpec]) -> None:
    """Exactly one control per descriptor port, in descriptor order, each conforming."""
    if [c.port_id for c in controls] != [p.port_id for p in ports]:
        raise DomainError.invalid(
            f"controls name ports {[c.port_id for c in controls]}; the descriptor declares "
            f"{[p.port_id for p in ports]}, in that order"
        )
    for control, port in zip(controls, ports, strict=True):
        check_port_control(control, port)


# --------------------------------------------------------------------------------------------
# the environment


@dataclass(frozen=True, slots=True)
class EnvironmentDescriptor:
    backend_digest: str
    content_digest: str
    configuration_digest: str
    step_duration: RationalNs
    ports: tuple[PortSpec, ...]
    inspection_schema: SchemaRef
    views: tuple[ViewDescriptor, ...]
    audio: tuple[AudioDescriptor, ...]
    recovery: Recovery
    determinism: Determinism

    @classmethod
    def from_json(cls, value: Any, what: str = "descriptor") -> EnvironmentDescriptor:
        keys = ("backendDigest", "contentDigest", "configurationDigest", "stepDuration", "ports",
                "inspectionSchema", "views", "audio", "recovery", "determinism")
        v = _object(value, keys, what)
        step = RationalNs.from_json(v["stepDuration"], f"{what}.stepDuration")
        if step.is_zero():
            raise DomainError.invalid(f"{what}.stepDuration must be > 0")
        ports = tuple(
            PortSpec.from_json(item, f"{what}.ports[{i}]")
            for i, item in enumerate(_list(v["ports"], f"{what}.ports"))
        )
        _unique([port.port_id for port in ports], f"{what}.ports")
        views = tuple(
            ViewDescriptor.from_json(item, f"{what}.views[{i}]")
            for i, item in enumerate(_list(v["views"], f"{what}.views", 8))
        )
        _unique([view.view_id for view in views], f"{what}.views")
        audio = tuple(
            AudioDescriptor.from_json(item, f"{what}.audio[{i}]")
            for i, item in enumerate(_list(v["audio"], f"{what}.audio", 8))
        )
        _unique([stream.stream_id for stream in audio], f"{what}.audio")
        recovery = _choice(v["recovery"], ("exact-checkpoint", "none"), f"{what}.recovery")
        determinism = _choice(v["determinism"], ("fixed-build", "none"), f"{what}.determinism")
        return cls(
            backend_digest=parse_digest(v["backendDigest"], f"{what}.backendDigest"),
            content_digest=parse_digest(v["contentDigest"], f"{what}.contentDigest"),
            configuration_digest=parse_digest(
                v["configurationDigest"], f"{what}.configurationDigest"
            ),
            step_duration=step,
            ports=ports,
            inspection_schema=SchemaRef.from_json(
                v["inspectionSchema"], f"{what}.inspectionSchema"
            ),
            views=views,
            audio=audio,
            recovery=cast(Recovery, recovery),
            determinism=cast(Determinism, determinism),
        )

    def port(self, port_id: str) -> PortSpec | None:
        return next((port for port in self.ports if port.port_id == port_id), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "backendDigest": self.backend_digest,
            "contentDigest": self.content_digest,
            "configurationDigest": self.configuration_digest,
            "stepDuration": self.step_duration.to_json(),
            "ports": [port.to_json() for port in self.ports],
            "inspectionSchema": self.inspection_schema.to_json(),
            "views": [view.to_json() for view in self.views],
            "audio": [stream.to_json() for stream in self.audio],
            "recovery": self.recovery,
            "determinism": self.determinism,
        }


@dataclass(frozen=True, slots=True)
class WorldObservation:
    boundary: int
    world_time: RationalNs
    engine_frame: str | None
    sensory_views: tuple[ViewRef, ...]
    inspection: TypedValue
    broadcast_views: tuple[str, ...]
    audio: tuple[AudioRef, ...]
    #: per-agent inputs, by port, of a world that offers them (absent from the JSON otherwise,
    #: so every other world's observation is byte-identical to v1's)
    agent_inputs: tuple[AgentInput, ...] | None = None

    @classmethod
    def from_json(cls, value: Any, what: str = "observation") -> WorldObservation:
        keys: tuple[str, ...] = ("boundary", "worldTime", "engineFrame", "sensoryViews",
                                 "inspection", "broadcastViews", "audio")
        if isinstance(value, dict) and "agentInputs" in value:
            keys = (*keys, "agentInputs")
        v = _object(value, keys, what)
        views = tuple(
            ViewRef.from_json(item, f"{what}.sensoryViews[{i}]")
            for i, item in enumerate(_list(v["sensoryViews"], f"{what}.sensoryViews", 8))
        )
        view_ids = [view.view_id for view in views]
        _unique(view_ids, f"{what}.sensoryViews")
        broadcast = _ids(v["broadcastViews"], f"{what}.broadcastViews", 8)
        for view_id in broadcast:
            if view_id not in view_ids:
                raise DomainError.invalid(
                    f"{what}.broadcastViews names {view_id}, which is not a sensory view"
                )
        audio = tuple(
            AudioRef.from_json(item, f"{what}.audio[{i}]")
            for i, item in enumerate(_list(v["audio"], f"{what}.audio", 8))
        )
        _unique([chunk.stream_id for chunk in audio], f"{what}.audio")
        frame = v["engineFrame"]
        return cls(
            boundary=parse_u64(v["boundary"], f"{what}.boundary"),
            world_time=RationalNs.from_json(v["worldTime"], f"{what}.worldTime"),
            engine_frame=None if frame is None else parse_string(frame, f"{what}.engineFrame"),
            sensory_views=views,
            inspection=TypedValue.from_json(v["inspection"], f"{what}.inspection"),
            broadcast_views=broadcast,
            audio=audio,
            agent_inputs=_agent_inputs(v["agentInputs"], f"{what}.agentInputs")
            if "agentInputs" in v else None,
        )

    def to_json(self) -> dict[str, Any]:
        doc = {
            "boundary": format_u64(self.boundary),
            "worldTime": self.world_time.to_json(),
            "engineFrame": self.engine_frame,
            "sensoryViews": [view.to_json() for view in self.sensory_views],
            "inspection": self.inspection.to_json(),
            "broadcastViews": list(self.broadcast_views),
            "audio": [chunk.to_json() for chunk in self.audio],
        }
        if self.agent_inputs is not None:
            doc["agentInputs"] = [a.to_json() for a in self.agent_inputs]
        return doc

    def agent_input(self, port_id: str) -> AgentInput | None:
        """The input of the agent on `port_id`, when the world gives per-agent inputs."""
        for item in self.agent_inputs or ():
            if item.port_id == port_id:
                return item
        return None


def _agent_inputs(value: Any, what: str) -> tuple[AgentInput, ...]:
    inputs = tuple(AgentInput.from_json(item, f"{what}[{i}]")
                   for i, item in enumerate(_list(value, what, MAX_AGENT_INPUTS)))
    _unique([a.port_id for a in inputs], what)
    return inputs
