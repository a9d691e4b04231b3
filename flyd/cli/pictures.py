"""Pictures of a run: `flyd run --record FILE.gif` and `flyd run --plot FILE.png`.

Why: people would rather look at a run than read its digests. Both pictures are drawn from the
boundaries the session committed (`flyd.session.sample.BoundarySample`, handed over by the
node's `GrantExecutor.on_boundary`), so they show the run the ledger holds.

Decisions:
- Pillow (`--record`) and matplotlib (`--plot`) are the optional extra `flyd[pictures]`; an
  option whose library is missing is `USAGE` (exit 2) naming the extra, before anything starts,
  as is a path that cannot be written (the file is created, truncated, at once).
- The GIF is written as the run goes, one frame at a time: its header when the first frame
  comes, then each frame's extension, descriptor, local colour table and LZW data (Pillow
  quantises and encodes one frame; nothing of an earlier frame is kept), the trailer at the
  end. Its memory is therefore flat in the run's length, and a run that dies leaves a GIF
  of the frames so far (the trailer is written whenever the command ends).
- The frames are the world's view (the first view the world declares; `Coordinator.
  committed_view`) of boundaries K, 2K, 3K, … (`--record-every K`, default 1; boundary 0 is
  not a transition's and is left out), at the view's own size. Each frame is shown for K world
  steps, at least 20 ms and at most 1 s (GIF delays are in hundredths of a second, and most
  viewers show shorter ones slower), and the GIF loops.
- A recovered session steps boundaries again; a boundary at or below the last one observed is
  ignored, so no frame is duplicated and no reward counted twice.
- The plot has a panel of each agent's cumulative reward over boundaries and one of the
  task's progress (its `counter`; `flyd.session.sample.progress_number`), when it has one. It
  keeps at most `MAX_POINTS` points per line however long the run: past that, every other
  point is dropped and then only every second boundary kept (the stride doubles).
- A world without views gives no GIF: the file is removed and stderr says why. A GIF frame
  that cannot be written mid-run (a full disk) fails the run at once, as a `--trace` write
  does (`flyd.session.outputs.OutputWriteError`, raised into the session through
  `on_boundary`); what fails after the run (the GIF's trailer, the plot, drawn at the end) can
  only be named on stderr. Neither changes the exit code, which is the run's.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

from flyd.session.outputs import OutputWriteError
from flyd.session.sample import BoundarySample, Frame

__all__ = ["EXTRA", "GifRecorder", "Pictures", "RewardPlot", "missing_extra"]

EXTRA: Final = "pictures"
#: most points one line of the plot keeps (module decisions)
MAX_POINTS: Final = 2048
MIN_DELAY_MS: Final = 20
MAX_DELAY_MS: Final = 1000
_LIBRARIES: Final = {"--record": ("PIL", "Pillow"), "--plot": ("matplotlib", "matplotlib")}


def missing_extra(option: str) -> str | None:
    """The usage error of `option` when its library is not installed, else None."""
    module, name = _LIBRARIES[option]
    if importlib.util.find_spec(module) is not None:
        return None
    return (f"{option} needs {name}, which is not installed: install the extra "
            f"`pip install 'flyd[{EXTRA}]'`")


def frame_delay_ms(step_ns: float, every: int) -> int:
    """How long one frame shows: `every` world steps, within the GIF's useful range."""
    ms = round(step_ns * every / 1e6 / 10) * 10
    return max(MIN_DELAY_MS, min(MAX_DELAY_MS, ms))


class GifRecorder:
    """An animated GIF written frame by frame to an open file (module decisions)."""

    def __init__(self, out: IO[bytes], every: int, delay_ms: int) -> None:
        self.out = out
        self.every = every
        self.delay_ms = delay_ms
        self.frames = 0
        self.size: tuple[int, int] | None = None
        self.skipped = 0  # frames of another size than the first

    def add(self, boundary: int, frame: Frame) -> None:
        """Append the frame of `boundary` when it is one of every K-th boundaries."""
        if boundary % self.every:
            return
        from PIL import GifImagePlugin, Image

        size = (frame.width, frame.height)
        if self.size is None:
            self.size = size
            self.out.write(_gif_header(size))
        elif size != self.size:
            self.skipped += 1
            return
        rgb = Image.frombytes("RGBA", size, frame.rgba).convert("RGB")
        indexed = rgb.quantize(colors=256)
        for chunk in GifImagePlugin.getdata(indexed, duration=self.delay_ms,
                                            include_color_table=True):
            self.out.write(chunk)
        self.frames += 1

    def close(self) -> None:
        if self.size is not None:
            self.out.write(b";")
        self.out.close()


def _gif_header(size: tuple[int, int]) -> bytes:
    """GIF89a, the logical screen without a global colour table (each frame has its own), and
    the NETSCAPE2.0 extension that loops the animation forever."""
    width, height = size
    screen = b"GIF89a" + width.to_bytes(2, "little") + height.to_bytes(2, "little") + b"\0\0\0"
    loop = b"!\xff\x0bNETSCAPE2.0\x03\x01\0\0\0"
    return screen + loop


@dataclass
class _Line:
    """One plotted line, decimated to at most `MAX_POINTS` points (module decisions)."""

    xs: list[int] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    stride: int = 1

    def add(self, x: int, y: float) -> None:
        if x % self.stride:
            return
        self.xs.append(x)
        self.ys.append(y)
        if len(self.xs) >= MAX_POINTS:
            self.stride *= 2
            keep = [i for i, b in enumerate(self.xs) if b % self.stride == 0]
            self.xs = [self.xs[i] for i in keep]
            self.ys = [self.ys[i] for i in keep]


class RewardPlot:
    """Each agent's cumulative reward and the task's progress over boundaries."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.rewards: dict[str, _Line] = {}
        self.progress = _Line()
        self.last = 0

    def add(self, sample: BoundarySample) -> None:
        for agent_id, reward in sample.rewards.items():
            total = self.totals.get(agent_id, 0.0) + reward
            self.totals[agent_id] = total
            self.rewards.setdefault(agent_id, _Line()).add(sample.boundary, total)
        if sample.progress is not None:
            self.progress.add(sample.boundary, sample.progress)
        self.last = sample.boundary

    def save(self, path: Path) -> None:
        """Draw the PNG (matplotlib's Agg backend: no display needed)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        panels = 2 if self.progress.xs else 1
        figure = Figure(figsize=(7.0, 2.6 * panels), dpi=100, layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
        for agent_id, line in sorted(self.rewards.items()):
            axes[0].plot(line.xs, line.ys, label=agent_id, linewidth=1.2)
        axes[0].set_ylabel("cumulative reward")
        if 0 < len(self.rewards) <= 12:
            axes[0].legend(loc="upper left", fontsize="small")
        if panels == 2:
            axes[1].plot(self.progress.xs, self.progress.ys, color="black", linewidth=1.2)
            axes[1].set_ylabel("task progress")
        axes[-1].set_xlabel("boundary")
        axes[-1].set_xlim(0, max(1, self.last))
        for ax in axes:
            ax.grid(alpha=0.3)
        figure.savefig(path, format="png")


class Pictures:
    """The pictures one `flyd run` asked for, fed each committed boundary once."""

    def __init__(self, record: tuple[Path, IO[bytes], int, int] | None,
                 plot: Path | None) -> None:
        self.gif: GifRecorder | None = None
        self.gif_path: Path | None = None
        if record is not None:
            self.gif_path, out, every, delay_ms = record
            self.gif = GifRecorder(out, every, delay_ms)
        self.plot_path = plot
        self.plot = RewardPlot() if plot is not None else None
        self.last = 0
        self.errors: list[str] = []

    def observe(self, sample: BoundarySample) -> None:
        """One committed boundary; one already observed (a recovery's re-step) is ignored."""
        if sample.boundary <= self.last:
            return
        self.last = sample.boundary
        if self.plot is not None:
            self.plot.add(sample)
        if self.gif is not None and sample.frame is not None:
            try:
                self.gif.add(sample.boundary, sample.frame)
            except OSError as exc:
                assert self.gif_path is not None
                self._gif_failed(f"cannot write: {exc.strerror or exc}")
                raise OutputWriteError("--record", self.gif_path, exc) from None

    def _gif_failed(self, reason: str) -> None:
        assert self.gif is not None
        self.errors.append(f"--record {self.gif_path}: {reason}")
        with contextlib.suppress(OSError):
            self.gif.out.close()
        self.gif = None

    def finish(self) -> list[str]:
        """End the GIF and draw the plot; the lines to print on stderr."""
        notes = list(self.errors)
        if self.gif is not None:
            assert self.gif_path is not None
            try:
                self.gif.close()
            except OSError as exc:
                notes.append(f"--record {self.gif_path}: cannot write: {exc.strerror or exc}")
            else:
                if self.gif.size is None:
                    self.gif_path.unlink(missing_ok=True)
                    notes.append(f"--record {self.gif_path}: no frame to record (the world "
                                 "declares no views, or the run committed fewer than "
                                 f"{self.gif.every} steps); no GIF written")
                else:
                    notes.append(f"--record {self.gif_path}: {self.gif.frames} frames of "
                                 f"{self.gif.size[0]}x{self.gif.size[1]}")
                if self.gif.skipped:
                    notes.append(f"--record {self.gif_path}: {self.gif.skipped} frames of "
                                 "another size than the first were left out")
        if self.plot is not None and self.plot_path is not None:
            try:
                self.plot.save(self.plot_path)
            except OSError as exc:
                notes.append(f"--plot {self.plot_path}: cannot write: {exc.strerror or exc}")
            else:
                notes.append(f"--plot {self.plot_path}: {self.last} boundaries")
        return notes
