"""What an observer of a run sees of one committed boundary (`flyd run --record`, `--plot`).

Why: pictures of a run are drawn from the boundaries the session committed, not from a second
copy of the world. The node builds a `BoundarySample` from its coordinator right after each
committed transition, only when someone asked for samples (`GrantExecutor.on_boundary`), so a
run without an observer pays nothing.

- `frame`: the committed observation's first declared view (`Coordinator.committed_view`), the
  world's order of declaration saying which view is meant for people; None for a world without
  views.
- `rewards`: per agent, the sum of the reward values the task gave it for this transition.
- `progress`: the task's progress as one number: the progress value itself when it is a number,
  else its `counter` field when that is a number (the synthetic and the example tasks), else
  None.

A recovered session steps some boundaries again; a sample names its boundary so an observer
keeps each boundary once.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyd.session.coordinator import Coordinator
from workers.types.datatypes import TypedValue

__all__ = ["BoundarySample", "Frame", "boundary_sample", "progress_number"]


@dataclass(frozen=True, slots=True)
class Frame:
    """One view's pixels: RGBA8, rows top to bottom, no padding."""

    view_id: str
    width: int
    height: int
    rgba: bytes


@dataclass(frozen=True, slots=True)
class BoundarySample:
    boundary: int
    frame: Frame | None
    rewards: dict[str, float]
    progress: float | None


def progress_number(progress: TypedValue | None) -> float | None:
    """The task's progress as one number (module rules), None when it has none."""
    if progress is None:
        return None
    value = progress.value
    if isinstance(value, dict):
        value = value.get("counter")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def boundary_sample(coordinator: Coordinator) -> BoundarySample | None:
    """The coordinator's last committed transition as a sample; None before the first one."""
    evaluation = coordinator.last_evaluation
    observation = coordinator.observation
    if evaluation is None or observation is None:
        return None
    view = coordinator.committed_view()
    frame = None if view is None else Frame(view[0].view_id, view[0].width, view[0].height,
                                            view[1])
    rewards = {agent_id: float(sum(r.value for r in evaluation.outcomes[agent_id].rewards))
               for agent_id in coordinator.agent_ids}
    return BoundarySample(observation.boundary, frame, rewards,
                          progress_number(evaluation.progress))
