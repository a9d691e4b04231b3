"""Worker-side `State.*`: capture, staged restore, activation, restore token, payload wrappers
(design/state.md §6).

Why: a checkpoint is only as good as the participants' promise that a capture reads without
mutating, that a restore is built beside the live state and installed in one step, and that an
activation happens once per incarnation. The agent and environment endpoints supply their own
wrappers (`Participant`); this module owns everything the two roles share: the check order, the
staged slot, the once-only token and the reply-size limit.

Rules (state machine of the staged slot, in the style of h11's `_state.py`):

1. `State.Capture` runs only at a quiescent `Ready(k)` of the current epoch; it moves the status
   `ready → capturing → ready` and changes neither progress nor live state. Checks in the order
   of design/state.md §6.2 (`CAPTURE_CHECKS`).
2. There is at most one staged restore (`StagedRestore`). `State.StageRestore` fills the slot
   from `uninitialized` or `ready` (status `staged-restore`, scope and progress untouched); a
   second stage while one is held is `CONFLICT` and keeps the first. Checks in the order of
   design/state.md §6.4.
3. `State.ActivateRestore` empties the slot into the live state (`staged-restore → restoring →
   ready`), adopts the proposed epoch and adds the token to the incarnation's activated set; the
   token can never activate again. Checks in the order of design/state.md §6.5. Its result also
   carries `observationDigests` (`Participant.observation_digests`: the environment's views as its
   restored world renders them now; null for an agent), which the coordinator compares with
   the checkpoint (design/session.md §6.12, amendment 2026-12-07). A `RESTORE_DIVERGED` raised while
   installing keeps its code; any other failure there is `BACKEND_FAILURE`/`unknown`.
   `fail_activate_restore` keeps the slot and makes the worker `failed`.
4. `TRANSITIONS` lists the status edges each method may take; every move goes through `_move`,
   which refuses any other edge as `INTERNAL` (a bug in this module, never a caller's error).
5. Every refusal is one `DomainError`; refusals before a mutation carry `none`.

Resolved ambiguities:
- "Staged" and "restoring" are worker states, not phases: a staged worker refuses Prepare,
  Advance and Commit (they need `ready`), and Capture (design/state.md §6.2 step 3).
- The stage's epoch check compares with the epoch this incarnation adopted (none for an
  uninitialized worker); re-adopting an older epoch is the cache's `INTERNAL` refusal, which the
  coordinator's fresh-epoch rule (design/state.md §7.1) already prevents.
- A wrapper whose member set is not exactly the documented one is `INCOMPATIBLE_STATE` (checked
  right after `payloadVersion`/`kind`): it is some other producer's state, not a bad request.
- The reply-size limit (design/state.md §6.2 step 7) is the router's worst-case `bus.result` frame
  (`bus.limits.result_frame`, the router's own rule) with the longest call id, this worker's
  responder and service incarnation; the limit is the `maxEnvelopeBytes` the router announced
  at hello (`Endpoint.reply_frame`, which the environment's observations use too).
- Plugin blobs are `{"digest", "data"}`; a digest that does not match `data` is
  `INCOMPATIBLE_STATE`, like a `restore` that refuses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

from workers.shell import Call, Endpoint, StatusCell, WorkerState
from workers.types.canonical import canonical, digest_bytes, digest_of, is_canonical, parse_strict
from workers.types.datatypes import EnvironmentDescriptor, MediaBlob
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    Scope,
    format_u64,
    parse_digest,
    parse_u64,
)

__all__ = [
    "CHECKPOINT_CAPABILITY",
    "PAYLOAD_CONTENT_TYPE",
    "PAYLOAD_VERSION",
    "STATE_FORMAT_ID",
    "STATE_METHODS",
    "TRANSITIONS",
    "Participant",
    "StagedRestore",
    "StateService",
    "check_provenance",
    "common_members",
    "compatibility_block",
    "decode_plugin_blob",
    "incompatible",
    "parse_digest_member",
    "parse_u64_member",
    "plugin_blob",
    "restore_token",
    "wrapper_object",
]

CHECKPOINT_CAPABILITY: Final = "checkpoint-v1"
PAYLOAD_CONTENT_TYPE: Final = "application/x-flyd-state"
PAYLOAD_VERSION: Final = 1
STATE_FORMAT_ID: Final = "flysess-1"
STATE_METHODS: Final = ("State.Capture", "State.StageRestore", "State.ActivateRestore")
TOKEN_DOMAIN: Final = "flyd/restore-token-v1\n"

TRANSITIONS: Final[dict[str, frozenset[tuple[WorkerState, WorkerState]]]] = {
    "State.Capture": frozenset({(WorkerState.READY, WorkerState.CAPTURING),
                                (WorkerState.CAPTURING, WorkerState.READY)}),
    "State.StageRestore": frozenset({(WorkerState.UNINITIALIZED, WorkerState.STAGED_RESTORE),
                                     (WorkerState.READY, WorkerState.STAGED_RESTORE)}),
    "State.ActivateRestore": frozenset({(WorkerState.STAGED_RESTORE, WorkerState.RESTORING),
                                        (WorkerState.RESTORING, WorkerState.READY),
                                        (WorkerState.STAGED_RESTORE, WorkerState.FAILED)}),
}

S = TypeVar("S")


# --------------------------------------------------------------------------------------------
# pure helpers


def _move(status: StatusCell, method: str, target: WorkerState) -> None:
    """Take one edge of `TRANSITIONS[method]`; any other is this module's bug."""
    if (status.state, target) not in TRANSITIONS[method]:
        raise DomainError(ErrorCode.INTERNAL, f"{method}: {status.state.value} -> "
                          f"{target.value} is not an edge", Mutation.NONE)
    status.state = target


def restore_token(checkpoint_id: str, scope: Scope, payload_digest: str,
                  incarnation_id: str) -> str:
    """`"rt-"` + 32 hex of SHA-256 over the token text of design/state.md §6.6 (the proposed
    scope)."""
    text = (f"{TOKEN_DOMAIN}{checkpoint_id}\n{scope.session_id}\n{scope.epoch}\n{scope.step}\n"
            f"{payload_digest}\n{incarnation_id}\n")
    return "rt-" + digest_bytes(text.encode("utf-8"))[:32]


def compatibility_block(descriptor: EnvironmentDescriptor) -> dict[str, Any]:
    """The design/state.md §3 block of a descriptor (the environment's side of
    `Compatibility.of`)."""
    raw = descriptor.to_json()
    return {
        "stateFormatId": STATE_FORMAT_ID,
        "backendDigest": raw["backendDigest"],
        "contentDigest": raw["contentDigest"],
        "patchDigest": raw["configurationDigest"],
        "controllerDigest": digest_of([{"portId": p["portId"], "controls": p["controls"]}
                                       for p in raw["ports"]]),
        "parserDigest": digest_of({"inspectionSchema": raw["inspectionSchema"]}),
    }


def incompatible(message: str) -> DomainError:
    return DomainError.before(ErrorCode.INCOMPATIBLE_STATE, message)


def plugin_blob(data: bytes) -> dict[str, str]:
    """A plugin's `capture()` bytes as embedded in a wrapper."""
    return {"digest": digest_bytes(data), "data": base64.b64encode(data).decode("ascii")}


def decode_plugin_blob(value: Any, what: str) -> bytes:
    """The bytes of an embedded plugin blob; `INCOMPATIBLE_STATE` when malformed or wrong."""
    if not isinstance(value, dict) or set(value) != {"digest", "data"} \
            or not isinstance(value["data"], str):
        raise incompatible(f"{what} is not a {{digest, data}} blob")
    try:
        data = base64.b64decode(value["data"], validate=True)
    except (binascii.Error, ValueError):
        raise incompatible(f"{what} is not valid base64") from None
    if hashlib.sha256(data).hexdigest() != value["digest"]:
        raise incompatible(f"{what} does not match its digest")
    return data


def common_members(kind: str, checkpoint_id: str, scope: Scope) -> dict[str, Any]:
    """The members every participant wrapper starts with (design/state.md §6.3)."""
    return {"payloadVersion": PAYLOAD_VERSION, "kind": kind, "checkpointId": checkpoint_id,
            "committedStep": format_u64(scope.step), "sourceScope": scope.to_json()}


def wrapper_object(data: bytes, kind: str, keys: frozenset[str]) -> dict[str, Any]:
    """Strict canonical JSON (`INVALID_ARGUMENT`), then version and kind, then the member set
    (`INCOMPATIBLE_STATE`)."""
    try:
        doc = parse_strict(data)
    except DomainError as exc:
        raise DomainError.invalid(f"the {kind} payload is not strict JSON: {exc.message}") \
            from None
    if not is_canonical(data) or not isinstance(doc, dict):
        raise DomainError.invalid(f"the {kind} payload is not a canonical JSON object")
    if doc.get("payloadVersion") != PAYLOAD_VERSION or doc.get("kind") != kind:
        raise incompatible(f"the payload is {doc.get('kind')!r} version "
                           f"{doc.get('payloadVersion')!r}; this worker reads {kind} version "
                           f"{PAYLOAD_VERSION}")
    if set(doc) != keys:
        missing = sorted(keys - set(doc))
        unknown = sorted(set(doc) - keys)
        raise incompatible(f"the {kind} payload members differ: missing {missing}, unknown "
                           f"{unknown}")
    return doc


def check_provenance(doc: Mapping[str, Any], params: Mapping[str, Any], scope: Scope) -> None:
    """`checkpointId`, `sourceScope`, `committedStep` against the params and the scope."""
    if doc["checkpointId"] != params["checkpointId"]:
        raise incompatible(f"the payload belongs to checkpoint {doc['checkpointId']!r}, not "
                           f"{params['checkpointId']}")
    if doc["sourceScope"] != params["sourceScope"]:
        raise incompatible("the payload's sourceScope differs from the request's")
    if doc["committedStep"] != format_u64(scope.step):
        raise incompatible(f"the payload is of step {doc['committedStep']!r}, not {scope.step}")


# --------------------------------------------------------------------------------------------
# the per-role part


class Participant(Protocol[S]):
    """What a role supplies: its wrapper, identity and install (called in the shell's model
    thread where marked)."""

    @property
    def epoch(self) -> str | None: ...

    def committed_step(self) -> int: ...

    def compatibility_digest(self) -> str: ...

    def identity(self) -> dict[str, Any] | None: ...

    def capture_wrapper(self, checkpoint_id: str, scope: Scope) -> dict[str, Any]:
        """The design/state.md §6.3 wrapper (model thread; read-only)."""
        ...

    def stage_wrapper(self, data: bytes, params: Mapping[str, Any], scope: Scope) -> S:
        """Validate the wrapper in its design/state.md §6.4 order and build the staged state beside
        the live one (model thread)."""
        ...

    def install(self, staged: S, scope: Scope) -> dict[str, Any] | None:
        """Install `staged` without advancing a tick; the reply's observation (model thread)."""
        ...

    async def seal_media(self, call: Call, observation: dict[str, Any] | None,
                         ) -> dict[str, Any] | None:
        """The reply's observation with the media `install` staged sealed and attached
        (topics.md §14.2 rule 7; on the loop)."""
        ...

    def observation_digests(self, boundary: int) -> list[dict[str, str]] | None:
        """After `install`: what the restored state observes now, per view in the behaviour
        record's form, for the coordinator to compare with the checkpoint (the environment's
        views; None for an agent). Model thread."""
        ...


@dataclass(frozen=True)
class StagedRestore(Generic[S]):
    """The one staged slot: checkpoint, proposed scope, token and the role's built state."""

    checkpoint_id: str
    scope: Scope
    token: str
    state: S


class StateService(Generic[S]):
    """The `State.*` handlers of one endpoint over its `Participant`."""

    def __init__(self, endpoint: Endpoint, participant: Participant[S]) -> None:
        self.endpoint = endpoint
        self.participant = participant
        self.staged: StagedRestore[S] | None = None
        self.activated: set[str] = set()

    def handlers(self) -> dict[str, Any]:
        return {"State.Capture": self.capture, "State.StageRestore": self.stage,
                "State.ActivateRestore": self.activate}

    # State.Capture (design/state.md §6.2) ---------------------------------------------------------

    async def capture(self, call: Call) -> dict[str, Any]:
        endpoint, participant = self.endpoint, self.participant
        method = call.method
        # 1–2: scope, session, initialized, epoch
        scope = endpoint.check_scope(call)
        status = endpoint.status
        if status.state == WorkerState.UNINITIALIZED:
            raise DomainError.before(ErrorCode.INVALID_PHASE,
                                     f"{method}: {endpoint.launch.worker_id} is uninitialized")
        if scope.epoch != participant.epoch:
            raise DomainError.before(
                ErrorCode.STALE_EPOCH,
                f"{method} names epoch {scope.epoch}; this worker is in epoch "
                f"{participant.epoch}")
        # 3: quiescent Ready(k)
        k = participant.committed_step()
        if status.state != WorkerState.READY:
            raise DomainError.before(
                ErrorCode.INVALID_PHASE,
                f"{method}: {endpoint.launch.worker_id} is {status.state.value} at step {k}; a "
                "capture needs a quiescent ready worker")
        endpoint.check_step(call, scope.step, k)
        # 4–5: params, fault
        call.check_params()
        if endpoint.launch.faults.fail_capture:
            raise DomainError.before(ErrorCode.BACKEND_FAILURE, "injected capture failure")
        # 6: build (read-only)
        checkpoint_id: str = call.params["checkpointId"]
        _move(status, method, WorkerState.CAPTURING)
        try:
            wrapper = await endpoint.run_model(
                method, lambda: participant.capture_wrapper(checkpoint_id, scope))
            data = canonical(wrapper)
        finally:
            _move(status, method, WorkerState.READY)
        payload = MediaBlob(PAYLOAD_CONTENT_TYPE, len(data), digest_bytes(data),
                            base64.b64encode(data).decode("ascii"))
        result = {"checkpointId": checkpoint_id, "boundary": format_u64(k),
                  "compatibilityDigest": participant.compatibility_digest(),
                  "agentIdentity": participant.identity(), "payload": payload.to_json()}
        # 7: one bus frame
        size, limit = self.endpoint.reply_frame(call, result)
        if size > limit:
            raise DomainError.before(
                ErrorCode.UNSUPPORTED,
                f"checkpoint payload of {len(data)} bytes does not fit one bus frame (limit "
                f"{limit})")
        return result

    # State.StageRestore (design/state.md §6.4) ----------------------------------------------------

    async def stage(self, call: Call) -> dict[str, Any]:
        endpoint, participant = self.endpoint, self.participant
        method = call.method
        # 1: scope, session
        scope = endpoint.check_scope(call)
        # 2: eligible states
        status = endpoint.status
        if status.state not in (WorkerState.UNINITIALIZED, WorkerState.READY,
                                WorkerState.STAGED_RESTORE):
            raise DomainError.before(
                ErrorCode.INVALID_PHASE,
                f"{method}: {endpoint.launch.worker_id} is {status.state.value}; a failed or "
                "mid-step worker cannot stage; replace it")
        # 3: one staged slot
        if self.staged is not None:
            raise DomainError.before(
                ErrorCode.CONFLICT,
                f"{method}: checkpoint {self.staged.checkpoint_id} is already staged for "
                f"{self.staged.scope}; it is kept")
        # 4: a new epoch
        if participant.epoch is not None and scope.epoch == participant.epoch:
            raise DomainError.before(
                ErrorCode.STALE_EPOCH,
                f"{method} names epoch {scope.epoch}, which this worker already runs; a restore "
                "needs a new epoch")
        # 5: params, source step
        call.check_params()
        p = call.params
        source = Scope.from_json(p["sourceScope"], "params.sourceScope")
        if source.step != scope.step:
            raise DomainError.invalid(f"{method}: sourceScope.step {source.step} differs from "
                                      f"the scope's step {scope.step}")
        # 6–7: the payload bytes
        blob = MediaBlob.from_json(p["payload"], "params.payload")
        data = _payload_bytes(blob)
        # 8: the role's wrapper, built beside the live state
        built = await endpoint.run_model(
            method, lambda: participant.stage_wrapper(data, p, scope))
        # 9: fault
        if endpoint.launch.faults.fail_stage_restore:
            raise incompatible("injected stage failure")
        # 10: token
        checkpoint_id: str = p["checkpointId"]
        token = restore_token(checkpoint_id, scope, blob.digest, endpoint.launch.incarnation_id)
        if token in self.activated:
            raise DomainError.before(ErrorCode.CONFLICT,
                                     f"{method}: restore token {token} was already activated "
                                     "by this incarnation")
        # 11–12: hold it
        _move(status, method, WorkerState.STAGED_RESTORE)
        self.staged = StagedRestore(checkpoint_id, scope, token, built)
        return {"checkpointId": checkpoint_id, "restoreToken": token}

    # State.ActivateRestore (design/state.md §6.5) -------------------------------------------------

    async def activate(self, call: Call) -> dict[str, Any]:
        endpoint, participant = self.endpoint, self.participant
        method = call.method
        # 1: scope, session, params
        scope = endpoint.check_scope(call)
        call.check_params()
        token: str = call.params["restoreToken"]
        # 2: once only
        if token in self.activated:
            raise DomainError.before(ErrorCode.CONFLICT,
                                     f"{method}: restore token {token} was already activated "
                                     "by this incarnation")
        # 3: something staged
        staged = self.staged
        if staged is None:
            raise DomainError.before(ErrorCode.INVALID_PHASE,
                                     f"{method}: {endpoint.launch.worker_id} has nothing staged")
        # 4: the staged token and scope
        if staged.token != token or staged.scope != scope:
            raise DomainError.before(
                ErrorCode.IDENTITY_MISMATCH,
                f"{method}: {token} at {scope} does not name the staged restore (token "
                f"{staged.token} at {staged.scope}); it is kept")
        # 5: fault
        status = endpoint.status
        if endpoint.launch.faults.fail_activate_restore:
            if status.state != WorkerState.FAILED:
                _move(status, method, WorkerState.FAILED)
            raise DomainError.before(ErrorCode.BACKEND_FAILURE,
                                     "injected activation failure; the staged restore is kept")
        # 6: install without a tick
        endpoint.shell.cache.adopt_epoch(scope.epoch)
        _move(status, method, WorkerState.RESTORING)
        try:
            observation, current = await endpoint.run_model(
                method, lambda: (participant.install(staged.state, scope),
                                 participant.observation_digests(scope.step)))
            observation = await participant.seal_media(call, observation)
        except DomainError as exc:
            if exc.code == ErrorCode.RESTORE_DIVERGED:
                # a world that finds its restored state diverged says so under its own code
                raise DomainError(exc.code, f"{method}: {exc.message}", Mutation.UNKNOWN) \
                    from None
            raise DomainError(ErrorCode.BACKEND_FAILURE, f"{method}: {exc.code}: {exc.message}",
                              Mutation.UNKNOWN) from None
        self.activated.add(token)
        self.staged = None
        _move(status, method, WorkerState.READY)
        status.current_scope = scope
        # 7
        return {"checkpointId": staged.checkpoint_id, "committedStep": format_u64(scope.step),
                "observation": observation, "observationDigests": current}


def _payload_bytes(blob: MediaBlob) -> bytes:
    """design/state.md §6.4 steps 6–7: content type and base64 (`BUFFER_INVALID`), then length and
    digest (`INCOMPATIBLE_STATE`)."""
    if blob.content_type != PAYLOAD_CONTENT_TYPE:
        raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                 f"the payload has content type {blob.content_type!r}; expected "
                                 f"{PAYLOAD_CONTENT_TYPE}")
    try:
        data = base64.b64decode(blob.data, validate=True)
    except (binascii.Error, ValueError):
        raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                 "the payload is not valid base64") from None
    if base64.b64encode(data).decode("ascii") != blob.data:
        raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                 "the payload is not canonical padded base64")
    if len(data) != blob.byte_length:
        raise incompatible(f"the payload decodes to {len(data)} bytes; byteLength says "
                           f"{blob.byte_length}")
    if digest_bytes(data) != blob.digest:
        raise incompatible("the payload does not match its digest")
    return data


def parse_u64_member(value: Any, what: str) -> int:
    """A wrapper's U64 member; `INCOMPATIBLE_STATE` when malformed."""
    try:
        return parse_u64(value, what)
    except DomainError as exc:
        raise incompatible(exc.message) from None


def parse_digest_member(value: Any, what: str) -> str:
    try:
        return parse_digest(value, what)
    except DomainError as exc:
        raise incompatible(exc.message) from None
