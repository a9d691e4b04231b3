"""Shared data types (session.md §1.8): exact shapes, round trips, media and control checks."""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

import pytest

from workers.types.canonical import digest_bytes, typed_digest
from workers.types.datatypes import (
    AssetRef,
    AudioDescriptor,
    AudioRef,
    ControllerSchema,
    EnvironmentDescriptor,
    Graph,
    MediaBlob,
    PortControl,
    Reward,
    SchemaRef,
    SensoryInput,
    Stimulus,
    Telemetry,
    TypedValue,
    ViewDescriptor,
    ViewRef,
    WorldObservation,
    check_controls,
    decode_audio,
    decode_media,
    decode_view,
    encode_media,
)
from workers.types.domain import DomainError, ErrorCode, Mutation
from workers.types.ticks import RationalNs

D = "ab" * 32
SCHEMA: dict[str, Any] = {"id": "arena.inspection.v1", "version": 1, "digest": D}
CONTROLLER: dict[str, Any] = {
    "schema": {"id": "arena.controller.v1", "version": 1, "digest": D},
    "buttons": ["inc", "dec"],
    "axes": [{"id": "bias", "range": "bipolar", "neutral": 0}],
}
PIXELS = bytes(range(256)) * 12  # 3072 bytes = 32 × 24 × 4
VIEW_DESCRIPTOR: dict[str, Any] = {
    "viewId": "arena", "width": 32, "height": 24, "format": "rgba8", "rowStride": 128,
    "pixelAspect": {"numerator": 1, "denominator": 1}, "observationDelaySteps": 0,
}
AUDIO_DESCRIPTOR: dict[str, Any] = {"streamId": "arena", "sampleRate": 48000, "channels": 2,
                    "format": "f32le-interleaved"}


def blob(content_type: str, data: bytes) -> dict[str, Any]:
    return {
        "contentType": content_type,
        "byteLength": str(len(data)),
        "digest": hashlib.sha256(data).hexdigest(),
        "data": base64.b64encode(data).decode(),
    }


def audio_bytes(frames: int, channels: int = 2, value: float = 0.25) -> bytes:
    return struct.pack(f"<{frames * channels}f", *([value] * frames * channels))


DESCRIPTOR: dict[str, Any] = {
    "backendDigest": D, "contentDigest": D, "configurationDigest": D,
    "stepDuration": {"numerator": "50000000", "denominator": "3"},
    "ports": [{"portId": "p1", "controls": CONTROLLER}, {"portId": "p2", "controls": CONTROLLER}],
    "inspectionSchema": SCHEMA,
    "views": [VIEW_DESCRIPTOR],
    "audio": [AUDIO_DESCRIPTOR],
    "recovery": "exact-checkpoint",
    "determinism": "fixed-build",
}
OBSERVATION: dict[str, Any] = {
    "boundary": "1",
    "worldTime": {"numerator": "50000000", "denominator": "3"},
    "engineFrame": "1",
    "sensoryViews": [{"viewId": "arena", "producedStep": "1",
                      "pixels": blob("image/x-rgba8", PIXELS)}],
    "inspection": {"schema": SCHEMA, "value": {"counter": 1, "boundary": 1}},
    "broadcastViews": ["arena"],
    "audio": [{"streamId": "arena", "firstSample": "0", "sampleFrames": 800,
               "samples": blob("audio/x-f32le", audio_bytes(800)), "discontinuity": False}],
}
TELEMETRY: dict[str, Any] = {
    "brainTicks": "10", "populationRateHz": 36.3,
    "rates": [{"roleId": "kc", "hz": 16.3}, {"roleId": "mbon", "hz": 7.3}],
    "learning": {"enabled": True, "updates": "3", "changed": "2", "signal": -1.0},
    "stimulusRemainingMs": None,
}
GRAPH: dict[str, Any] = {"datasetDigest": D, "indexDigest": D, "neuronCount": "1024",
         "rateRoles": ["kc", "mbon"], "supportedStimuli": ["arena.milestone"]}


def invalid(call: Any, *args: Any) -> str:
    with pytest.raises(DomainError) as info:
        call(*args)
    assert (info.value.code, info.value.mutation) == (ErrorCode.INVALID_ARGUMENT, Mutation.NONE)
    return info.value.message


def test_every_shape_round_trips() -> None:
    cases: list[tuple[Any, dict[str, Any]]] = [
        (SchemaRef, SCHEMA),
        (TypedValue, {"schema": SCHEMA, "value": {"a": [1, 2.5, None]}}),
        (AssetRef, {"id": "arena-direct-v1-fly-a", "digest": D, "byteLength": "53",
                    "format": "fly-profile-v1"}),
        (MediaBlob, blob("image/x-rgba8", b"abc")),
        (ViewDescriptor, VIEW_DESCRIPTOR),
        (AudioDescriptor, AUDIO_DESCRIPTOR),
        (SensoryInput, {"boundary": "0", "views": OBSERVATION["sensoryViews"],
                        "structured": None}),
        (Stimulus, {"id": "ev-1", "kindId": "arena.milestone", "durationMs": 4.0}),
        (Reward, {"eventId": "ev-1", "ruleId": "counter-delta", "value": -1.0}),
        (Telemetry, TELEMETRY),
        (Graph, GRAPH),
        (ControllerSchema, CONTROLLER),
        (PortControl, {"portId": "p1", "buttons": [{"id": "inc", "down": True}],
                       "axes": [{"id": "bias", "value": -0.5}]}),
        (EnvironmentDescriptor, DESCRIPTOR),
        (WorldObservation, OBSERVATION),
    ]
    for cls, value in cases:
        parsed = cls.from_json(value)
        assert parsed.to_json() == value, cls
        assert cls.from_json(parsed.to_json()) == parsed
    tv = TypedValue.from_json({"schema": SCHEMA, "value": {"counter": 0}})
    assert typed_digest(tv) == typed_digest({"schema": SCHEMA, "value": {"counter": 0}})
    descriptor = EnvironmentDescriptor.from_json(DESCRIPTOR)
    assert descriptor.step_duration == RationalNs(50000000, 3)
    assert descriptor.views[0].byte_length == 3072


def test_shapes_refuse_unknown_missing_and_out_of_range_fields() -> None:
    assert "unknown" in invalid(SchemaRef.from_json, {**SCHEMA, "x": 1})
    assert "missing" in invalid(SchemaRef.from_json, {"id": "a", "version": 1})
    invalid(SchemaRef.from_json, {**SCHEMA, "version": 0})
    invalid(SchemaRef.from_json, {**SCHEMA, "version": 65536})
    invalid(SchemaRef.from_json, {**SCHEMA, "version": True})
    invalid(SchemaRef.from_json, {**SCHEMA, "version": 1.0})
    invalid(TypedValue.from_json, {"schema": SCHEMA, "value": "x" * 33000})
    invalid(TypedValue.from_json, {"schema": SCHEMA, "value": float("nan")})
    invalid(ViewDescriptor.from_json, {**VIEW_DESCRIPTOR, "rowStride": 127})
    invalid(ViewDescriptor.from_json, {**VIEW_DESCRIPTOR, "width": 4097})
    invalid(ViewDescriptor.from_json, {**VIEW_DESCRIPTOR, "format": "rgb8"})
    invalid(ViewDescriptor.from_json, {**VIEW_DESCRIPTOR, "observationDelaySteps": 9})
    invalid(AudioDescriptor.from_json, {**AUDIO_DESCRIPTOR, "sampleRate": 7999})
    invalid(AudioDescriptor.from_json, {**AUDIO_DESCRIPTOR, "channels": 9})
    invalid(Stimulus.from_json, {"id": "s", "kindId": "k", "durationMs": 0})
    invalid(Reward.from_json, {"eventId": "e", "ruleId": "r", "value": float("inf")})
    invalid(Telemetry.from_json, {**TELEMETRY, "populationRateHz": -0.1})
    invalid(Telemetry.from_json, {**TELEMETRY, "learning": {**TELEMETRY["learning"],
                                                             "changed": "4"}})
    invalid(Telemetry.from_json, {**TELEMETRY, "rates": TELEMETRY["rates"] * 2})
    invalid(SensoryInput.from_json, {"boundary": "0", "views": OBSERVATION["sensoryViews"] * 2,
                                     "structured": None})
    invalid(SensoryInput.from_json, {"boundary": "0", "views": []})
    invalid(ControllerSchema.from_json, {**CONTROLLER, "buttons": ["inc", "inc"]})
    invalid(ControllerSchema.from_json, {**CONTROLLER, "axes": [
        {"id": "bias", "range": "unipolar", "neutral": -1}]})
    invalid(EnvironmentDescriptor.from_json, {**DESCRIPTOR, "ports": DESCRIPTOR["ports"][:1] * 2})
    invalid(EnvironmentDescriptor.from_json, {**DESCRIPTOR, "recovery": "maybe"})
    invalid(EnvironmentDescriptor.from_json,
            {**DESCRIPTOR, "stepDuration": {"numerator": "0", "denominator": "1"}})
    invalid(WorldObservation.from_json, {**OBSERVATION, "broadcastViews": ["other"]})
    invalid(WorldObservation.from_json, {**OBSERVATION, "engineFrame": 1})

    telemetry = Telemetry.from_json(TELEMETRY)
    telemetry.check_rates(Graph.from_json(GRAPH))
    invalid(telemetry.check_rates, Graph.from_json({**GRAPH, "rateRoles": ["mbon", "kc"]}))
    invalid(telemetry.check_rates, Graph.from_json({**GRAPH, "rateRoles": ["kc"]}))


def buffer_invalid(call: Any, *args: Any) -> DomainError:
    with pytest.raises(DomainError) as info:
        call(*args)
    assert info.value.code == ErrorCode.BUFFER_INVALID
    return info.value


def test_media_is_decoded_and_checked() -> None:
    view = ViewRef.from_json(OBSERVATION["sensoryViews"][0])
    descriptor = ViewDescriptor.from_json(VIEW_DESCRIPTOR)
    assert decode_view(view, descriptor) == PIXELS
    assert encode_media("image/x-rgba8", PIXELS) == view.pixels

    short = ViewRef.from_json({"viewId": "arena", "producedStep": "1",
                               "pixels": blob("image/x-rgba8", PIXELS[:-128])})
    error = buffer_invalid(decode_view, short, descriptor)
    assert error.message == "view arena has 2944 bytes; the descriptor requires 3072"
    assert error.mutation == Mutation.NONE
    error = buffer_invalid(decode_view, short, descriptor, Mutation.UNKNOWN)
    assert error.mutation == Mutation.UNKNOWN  # the coordinator's Phase C

    good = MediaBlob.from_json(blob("image/x-rgba8", b"abcd"))
    assert decode_media(good, "image/x-rgba8", "view v") == b"abcd"
    assert "view v" in buffer_invalid(decode_media, good, "audio/x-f32le", "view v").message
    for bad in [
        MediaBlob("image/x-rgba8", 4, good.digest, "YWJjZA"),  # no padding
        MediaBlob("image/x-rgba8", 4, good.digest, "YWJjZA=="[:-1] + "!"),
        MediaBlob("image/x-rgba8", 4, good.digest, "YWJjZB=="),  # non-canonical bits
        MediaBlob("image/x-rgba8", 5, good.digest, good.data),
        MediaBlob("image/x-rgba8", 4, digest_bytes(b"abce"), good.data),
    ]:
        buffer_invalid(decode_media, bad, "image/x-rgba8", "view v")

    stream = AudioDescriptor.from_json(AUDIO_DESCRIPTOR)
    chunk = AudioRef.from_json(OBSERVATION["audio"][0])
    assert len(decode_audio(chunk, stream)) == 6400
    nan_chunk = AudioRef("arena", 0, 1, encode_media("audio/x-f32le",
                                                     audio_bytes(1, value=float("nan"))), False)
    assert "not finite" in buffer_invalid(decode_audio, nan_chunk, stream).message
    wrong_size = AudioRef("arena", 0, 2, encode_media("audio/x-f32le", audio_bytes(1)), False)
    assert "audio stream arena" in buffer_invalid(decode_audio, wrong_size, stream).message


def test_controls_follow_the_descriptor_exactly() -> None:
    ports = EnvironmentDescriptor.from_json(DESCRIPTOR).ports

    def control(port: str, inc: bool = True, bias: float = 0.0,
                buttons: tuple[str, ...] = ("inc", "dec")) -> PortControl:
        return PortControl.from_json({
            "portId": port,
            "buttons": [{"id": b, "down": inc if b == "inc" else False} for b in buttons],
            "axes": [{"id": "bias", "value": bias}],
        })

    check_controls([control("p1"), control("p2", bias=-1.0)], ports)
    assert "p2" in invalid(check_controls, [control("p1"), control("p2", bias=1.5)], ports)
    assert "p1" in invalid(check_controls, [control("p1", buttons=("dec", "inc")),
                                            control("p2")], ports)
    invalid(check_controls, [control("p2"), control("p1")], ports)
    invalid(check_controls, [control("p1")], ports)
