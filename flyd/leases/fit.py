"""Claims fit first: which runs a node can take now, decided inside the claim
(design/distribution.md §3.3, §5.7; docs/distribution.md, "Claims fit first").

Why: a node used to claim the next run, find in its executor that the run's threads did not fit
its remaining budget, and release it with refund. Each such round bumped the run's lease epoch
(up to 3 times right after another run ended) and wrote a grant and an attempt row for nothing.
Now the claim itself skips a run that does not fit: the node passes its room (`Fit`) and the
store picks, in run order, only runs whose need fits, and a batch only while their needs add up
within it. A run that fits no node stays `pending`, untouched.

A run's need is `per_run` (the node's coordinator reservation) + `worker_threads(spec)`: the
world's `threads` plus every agent's `threads`, each defaulting to 1, and the two default agents
when `agents` is absent. This is the run spec's `thread_need` (flyd.session.runspec, a layer
above) read straight off the stored document, here and in SQL (`WORKER_THREADS_SQL`, one
expression over the row's `spec`), so the PostgreSQL store and the in-memory one agree. A
malformed `threads` (not an integer in 0..9 999 999) or a malformed `world`/`agents` counts 0:
such a run is claimed and fails on its first claim naming the field, as before. The executor still
checks fit after the claim, so an estimate that ever differs costs one release, not a lost run.

The room is the node's thread budget total less the needs of the grants it holds (computed by
the runtime from the grants' specs at claim time, so a grant whose workers are not launched yet
is counted too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["DEFAULT_AGENT_COUNT", "MAX_COUNTED_THREADS", "WORKER_THREADS_SQL", "Fit",
           "ThreadRoom", "fitting", "worker_threads"]

#: a stored spec without `agents` has the two default agents (design/session.md §4.7)
DEFAULT_AGENT_COUNT: Final = 2
#: a `threads` above this is malformed (the spec allows 1..256) and counts 0
MAX_COUNTED_THREADS: Final = 9_999_999

_ONE_SQL: Final = (
    "(CASE WHEN jsonb_typeof({x}) IS DISTINCT FROM 'object' THEN 0"
    " WHEN NOT ({x}) ? 'threads' THEN 1"
    " WHEN jsonb_typeof(({x}) -> 'threads') = 'number'"
    " AND (({x}) ->> 'threads') ~ '^[0-9]{{1,7}}$' THEN (({x}) ->> 'threads')::bigint"
    " ELSE 0 END)")

#: `worker_threads(spec)` as a bigint SQL expression over the column `spec`
WORKER_THREADS_SQL: Final = (
    "(CASE WHEN jsonb_typeof(spec) IS DISTINCT FROM 'object' THEN 0 ELSE "
    + _ONE_SQL.format(x="coalesce(spec -> 'world', '{}'::jsonb)")
    + " + CASE WHEN NOT spec ? 'agents' THEN " + str(DEFAULT_AGENT_COUNT)
    + " WHEN jsonb_typeof(spec -> 'agents') <> 'array' THEN 0"
    " ELSE (SELECT coalesce(sum(" + _ONE_SQL.format(x="a") + "), 0)"
    " FROM jsonb_array_elements(spec -> 'agents') AS a) END END)")


@dataclass(frozen=True, slots=True)
class Fit:
    """One claim's room: the threads free now, and what every run needs beyond its workers."""

    room: int
    per_run: int

    def need(self, spec: Any) -> int:
        return self.per_run + worker_threads(spec)


@dataclass(frozen=True, slots=True)
class ThreadRoom:
    """A node's thread budget as the claimer sees it (`[node] threads`, the reservation)."""

    total: int
    per_run: int

    def fit(self, held_specs: Iterable[Any]) -> Fit:
        """The room left by the runs whose specs are held."""
        used = sum(self.per_run + worker_threads(spec) for spec in held_specs)
        return Fit(self.total - used, self.per_run)


def _threads(obj: Any) -> int:
    if not isinstance(obj, Mapping):
        return 0
    if "threads" not in obj:
        return 1
    value = obj["threads"]
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 0 <= value <= MAX_COUNTED_THREADS:
        return 0
    return value


def worker_threads(spec: Any) -> int:
    """The worker threads a stored spec asks for (module docstring); pure."""
    if not isinstance(spec, Mapping):
        return 0
    world = _threads(spec.get("world", {}))
    if "agents" not in spec:
        return world + DEFAULT_AGENT_COUNT
    agents = spec["agents"]
    if not isinstance(agents, list):
        return world
    return world + sum(_threads(a) for a in agents)


def fitting(needs: Iterable[int], room: int) -> int:
    """How many of the first candidates (already each within `room`) fit together."""
    used = 0
    count = 0
    for need in needs:
        used += need
        if used > room:
            break
        count += 1
    return count
