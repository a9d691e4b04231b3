"""Why a run ended other than `succeeded`, as one `{error, …}` value and one line of text. Pure.

Why: a run's `outcome` column has several shapes (design/state.md §9.3,
design/distribution.md §3.7): the session's own `{error: …}` values, the reaper's `{reaped: …}`, a
refused restore's `{code, message, checkpointId}`, a cancellation's counters. `flyd run` (summary,
stderr) and `flyctl runs show` must name the reason whatever the shape, so both go through
`failure_of`.

Rules:
- `failure_of(state, outcome, …)` is None for `succeeded`; otherwise the outcome with an `error`
  key: kept when present; else `reaped`'s text (`attempts exhausted`, `cancel requested, holder
  gone`), `restore refused` for a `{code, message}` outcome, `cancelled` for a cancellation,
  `abandoned` when there is no terminal outcome at all (the caller stopped waiting).
- `last_loss` (the reason this process's node lost its last lease, e.g.
  `unknown_outcome_lost`) and `last_grant` (the last `run_attempts` row: node and end reason)
  are added to an `attempts exhausted` outcome as `lastLeaseLoss` and `lastGrant`: the reaper
  only knows that the attempts ran out, the node knows why the last one did.
- A durable capture a participant refused is one failure document (`{detail: "capture",
  participant, code, mutation, message, checkpointId}`, `flyd.node.grant`): the outcome's
  `failure` when it ends the run at once (`checkpoint capture refused`), `lastCaptureRefusal`
  when the node ended the run after its last attempt (`attempts exhausted`). Either way the
  text names it the same: `checkpoint capture refused by arena: UNSUPPORTED: checkpoint payload
  of 90000 bytes does not fit one bus frame (limit 65536)`, after `attempts exhausted (` in
  the second case, before the lease loss and the last grant.
- `describe(failure)` is the one-line reason: the error and the fields that explain it (sizes
  and limits, the spec path, the worker and its error code, the last failure or lease loss).
  A `plugin failed` outcome names the plugin's import path, the stage, the worker, what failed
  and the exception with its message: `plugin failed: pkg.mod:Model (construct) of ant-1 at
  Agent.Initialize: ValueError: bad gain 42`.
- An `output write failed` outcome names the option, the path and the errno: `output write
  failed: --trace /mnt/full/trace.jsonl: ENOSPC (No space left on device)`.
- `traceback_of(failure)` is the plugin fault's last frames (innermost last), from the outcome's
  `plugin`, or from the `plugin` of its `failure`, `lastFailure` or `lastCaptureRefusal` (a
  launch failure, exhausted attempts); `flyd run` prints them on stderr and `flyctl runs show`
  under the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["describe", "failure_of", "plugin_of", "traceback_of"]


def failure_of(state: str, outcome: Mapping[str, Any] | None, *, last_loss: str | None = None,
               last_grant: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The `{error, …}` reason of a run in `state` with `outcome` (module rules)."""
    if state == "succeeded":
        return None
    doc: dict[str, Any] = dict(outcome or {})
    if "error" not in doc:
        if "reaped" in doc:
            doc["error"] = str(doc["reaped"])
        elif "code" in doc and "message" in doc:
            doc["error"] = "restore refused"
        elif state == "cancelled":
            doc["error"] = "cancelled"
        elif state == "failed":
            doc["error"] = "failed without an outcome"
        else:
            doc["error"] = "abandoned"
            doc.setdefault("state", state)
    if doc["error"] == "attempts exhausted":
        if last_loss is not None:
            doc["lastLeaseLoss"] = last_loss
        if last_grant is not None:
            doc["lastGrant"] = dict(last_grant)
    return doc


def plugin_of(failure: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The plugin fault that explains a failure, wherever its shape keeps it."""
    for doc in (failure, failure.get("failure"), failure.get("lastFailure"),
                failure.get("lastCaptureRefusal")):
        if isinstance(doc, Mapping) and isinstance(doc.get("plugin"), Mapping):
            plugin: Mapping[str, Any] = doc["plugin"]
            return plugin
    return None


def traceback_of(failure: Mapping[str, Any]) -> list[str]:
    """The plugin fault's last traceback frames, innermost last (none without a fault)."""
    plugin = plugin_of(failure)
    frames = plugin.get("frames") if plugin is not None else None
    return [str(f) for f in frames] if isinstance(frames, list) else []


def _exception(plugin: Mapping[str, Any]) -> str:
    message = plugin.get("message")
    return f"{plugin.get('exception')}: {message}" if message else str(plugin.get("exception"))


def _capture_refusal(refusal: Mapping[str, Any]) -> str:
    who = refusal.get("participant") or "a participant"
    return f"checkpoint capture refused by {who}: {refusal.get('code')}: {refusal.get('message')}"


def describe(failure: Mapping[str, Any]) -> str:
    """One line naming the reason and what explains it."""
    error = str(failure.get("error"))
    if error == "plugin failed":
        f = failure.get("failure") or {}
        plugin = failure.get("plugin") or {}
        who = f" of {f['participant']}" if f.get("participant") else ""
        name = str(plugin.get("plugin") or "a plugin")
        return (f"plugin failed: {name} ({plugin.get('stage')}){who} at {f.get('detail')}: "
                f"{_exception(plugin)}")
    if error == "checkpoint too large":
        if failure.get("payloadCount") is not None:
            return (f"checkpoint too large: {failure['payloadCount']} payloads, an envelope "
                    f"holds {failure.get('payloadLimit')}")
        return (f"checkpoint too large: {failure.get('byteLength')} bytes, max_envelope_bytes "
                f"{failure.get('limit')}")
    if error == "checkpoint capture refused":
        refusal = failure.get("failure") or {}
        return f"{_capture_refusal(refusal)} (checkpoint {refusal.get('checkpointId')})"
    if error == "attempts exhausted":
        why = []
        refusal = failure.get("lastCaptureRefusal")
        if isinstance(refusal, Mapping):
            why.append(_capture_refusal(refusal))
        if failure.get("lastLeaseLoss"):
            why.append(f"last lease loss: {failure['lastLeaseLoss']}")
        grant = failure.get("lastGrant")
        if isinstance(grant, Mapping):
            why.append(f"last grant {grant.get('leaseEpoch')} on {grant.get('nodeId')} "
                       f"ended {grant.get('endReason')}")
        return "attempts exhausted" + (f" ({'; '.join(why)})" if why else "")
    if error == "output write failed":
        return (f"output write failed: {failure.get('option')} {failure.get('path')}: "
                f"{failure.get('errno')} ({failure.get('message')})")
    if error == "invalid run spec":
        return f"invalid run spec at {failure.get('path')}: {failure.get('reason')}"
    if error == "launch failed":
        f = failure.get("failure") or {}
        who = f.get("participant") or "a worker"
        return f"launch failed: {who}: {f.get('code')}: {f.get('message')}"
    if error == "recovery attempts exhausted":
        last = failure.get("lastFailure") or {}
        who = f" of {last['participant']}" if last.get("participant") else ""
        return (f"recovery attempts exhausted after {failure.get('attempts')} attempts; last "
                f"failure {last.get('detail')}{who}: {last.get('code')}: {last.get('message')}")
    if error == "restore refused":
        return (f"restore refused: {failure.get('code')}: {failure.get('message')} "
                f"(checkpoint {failure.get('checkpointId')})")
    detail = failure.get("message")
    return f"{error}: {detail}" if detail else error
