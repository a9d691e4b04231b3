"""The decoded media of one boundary, and the checks that produce them (design/session.md §6.5,
§6.6; design/state.md §7.5). Pure, no I/O.

Why a module of its own: bootstrap checks O[0]'s views, every transition checks O[k+1]'s views
and audio, and a restore checks the restored observation's views, all with one rule. `Media`
holds what a boundary decoded (views and audio chunks by id); `HeldMedia` is the committed
boundary's and the in-flight transition's, which the coordinator keeps.

Rules:
- `check_views`: every declared view is present, produced at `max(0, boundary - delay)`, and
  decodes against its declaration; else `BUFFER_INVALID` with the caller's mutation.
- `check_audio`: every declared stream produced a chunk that decodes (`BUFFER_INVALID`/
  `unknown`), and the chunks continue their timelines (`AudioTimelines.check`).
- By reference (topics.md §14.2): `attached` are the result's attachments, opened; a
  by-reference blob decodes only from the attachment it names, of its length and digest
  (`workers.types.datatypes.decode_media`). `Media.held` are the artifact ids the coordinator's
  connection holds for these media: whoever replaces a `Media` drops the ids the new one does
  not hold (`released`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from flyd.session.audio import AudioTimelines
from workers.types.datatypes import (
    Attached,
    EnvironmentDescriptor,
    WorldObservation,
    decode_audio,
    decode_view,
)
from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = ["HeldMedia", "Media", "check_audio", "check_views", "released"]


@dataclass
class Media:
    views: dict[str, bytes] = field(default_factory=dict)
    audio: dict[str, bytes] = field(default_factory=dict)
    held: tuple[str, ...] = ()

    def count(self) -> int:
        return len(self.views) + len(self.audio)


class HeldMedia:
    """The committed boundary's media and the in-flight transition's. Replacing either drops
    (`drop`, the connection's artifact holds, topics.md §14.2 rule 5) the artifact ids
    that neither of them keeps any more."""

    def __init__(self, drop: Callable[[Sequence[str]], None]) -> None:
        self.committed = Media()
        self.pending = Media()
        self._drop = drop

    def replace(self, *, committed: Media | None = None, pending: Media | None = None) -> None:
        old = (self.committed, self.pending)
        if committed is not None:
            self.committed = committed
        if pending is not None:
            self.pending = pending
        keep = set(self.committed.held) | set(self.pending.held)
        self._drop([a for media in old for a in media.held if a not in keep])

    def count(self) -> int:
        """The decoded views and audio chunks held (design/session.md §6.3: none once an epoch
        failed)."""
        return self.committed.count() + self.pending.count()


def released(old: Media, new: Media) -> list[str]:
    """The artifact ids `old` holds and `new` does not: to drop when `new` replaces `old`."""
    keep = set(new.held)
    return [a for a in old.held if a not in keep]


def check_views(descriptor: EnvironmentDescriptor, observation: WorldObservation,
                boundary: int, mutation: Mutation,
                attached: Mapping[str, Attached] | None = None) -> Media:
    media = Media()
    by_id = {v.view_id: v for v in observation.sensory_views}
    for view in descriptor.views:
        ref = by_id.get(view.view_id)
        if ref is None:
            raise DomainError(ErrorCode.BUFFER_INVALID,
                              f"view {view.view_id} is missing at boundary {boundary}",
                              mutation)
        want = max(0, boundary - view.observation_delay_steps)
        if ref.produced_step != want:
            raise DomainError(ErrorCode.BUFFER_INVALID,
                              f"view {view.view_id} at boundary {boundary} was produced at "
                              f"{ref.produced_step}; the descriptor requires {want}",
                              mutation)
        media.views[view.view_id] = decode_view(ref, view, mutation, attached)
    return media


def check_audio(descriptor: EnvironmentDescriptor, observation: WorldObservation,
                media: Media, timelines: AudioTimelines,
                attached: Mapping[str, Attached] | None = None) -> None:
    by_id = {a.stream_id: a for a in observation.audio}
    for stream in descriptor.audio:
        chunk = by_id.get(stream.stream_id)
        if chunk is None:
            raise DomainError(ErrorCode.BUFFER_INVALID,
                              f"audio stream {stream.stream_id} produced no chunk for this "
                              "transition", Mutation.UNKNOWN)
        media.audio[stream.stream_id] = decode_audio(chunk, stream, Mutation.UNKNOWN, attached)
    timelines.check(observation.audio, Mutation.UNKNOWN)
