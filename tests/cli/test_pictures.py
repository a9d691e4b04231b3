"""`flyd run --record FILE.gif` and `--plot FILE.png` (flyd.cli.pictures): real `flyd run`
subprocesses on the synthetic composition (its `arena` view) and on the reaching example
(`--spec examples/reaching/run.json --plugin-path <root>`, its `top-down` view), the files
decoded (frame count, size, pixels that vary; the plot's lines against the totals `flyctl runs
export` gives); usage errors before anything starts; the
recorder's memory flat in the run's length.
"""

from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import tracemalloc
from pathlib import Path

import orjson
import pytest
from PIL import Image, ImageSequence

from flyd.cli.pictures import MAX_POINTS, GifRecorder, RewardPlot
from flyd.session.sample import BoundarySample, Frame
from tests.cli import test_fly_arena as fly_arena
from tests.cli import test_plugins_example as reaching
from tests.cli.test_flyctl_runs import FLYCTL
from tests.cli.test_run import ROOT, clean_digest, env_for, flyd_run
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)


def gif_frames(path: Path) -> list[Image.Image]:
    with Image.open(path) as gif:
        assert gif.format == "GIF"
        return [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]


def varies(image: Image.Image) -> bool:
    """Whether the image has more than one colour."""
    return any(low != high for low, high in image.getextrema())


def check_png(path: Path) -> None:
    with Image.open(path) as png:
        assert png.format == "PNG"
        assert png.size == (700, 520)  # two panels: rewards and the task's progress
        assert varies(png.convert("RGB"))


# matplotlib's first two cycle colours (tab:blue, tab:orange): the plot's agents in sorted order
LINE_COLOURS = ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E))


def exported_totals(tmp: Path, run: int) -> dict[str, list[float]]:
    """Each agent's cumulative reward at boundaries 1..n, from `flyctl runs export` (the effects
    the run committed), not from the picture code."""
    ran = subprocess.run([*FLYCTL, "runs", "export", str(run)], cwd=ROOT, env=env_for(tmp),
                         capture_output=True, timeout=60, check=False)
    assert ran.returncode == 0, ran.stderr
    totals: dict[str, list[float]] = {}
    for line in ran.stdout.splitlines():
        doc = orjson.loads(line)
        for agent_id, rewards in doc["rewards"].items():
            seen = totals.setdefault(agent_id, [])
            seen.append((seen[-1] if seen else 0.0) + sum(r["value"] for r in rewards))
    return totals


def line_heights(image: Image.Image, colour: tuple[int, int, int], top: int,
                 bottom: int) -> dict[int, float]:
    """The median row of `colour`'s pixels in each column between rows `top` and `bottom`."""
    rows: dict[int, list[int]] = {}
    pixels = image.load()
    assert pixels is not None
    for x in range(image.width):
        for y in range(top, bottom):
            if all(abs(a - b) <= 24 for a, b in zip(pixels[x, y], colour, strict=True)):
                rows.setdefault(x, []).append(y)
    return {x: sorted(ys)[len(ys) // 2] for x, ys in rows.items()}


def check_plotted_lines(path: Path, totals: dict[str, list[float]]) -> None:
    """The rewards panel draws each agent's cumulative reward: at each boundary the line's
    height is one affine function of the exported total (the same for every agent), so empty
    axes, a missing agent or a line of other data fail. Columns come from the axes' frame (x
    from 0 to the last boundary); the legend's corner (boundaries below 8) is left out."""
    with Image.open(path) as png:
        image = png.convert("RGB")
    half = image.height // 2
    pixels = image.load()
    assert pixels is not None
    # the axes' frame: dark columns over most of the panel, at boundary 0 and at the last one
    spines = [x for x in range(image.width)
              if sum(max(pixels[x, y]) < 100 for y in range(half)) > half // 2]
    assert len(spines) == 2, f"no axes frame in the rewards panel: {spines}"
    steps = len(next(iter(totals.values())))
    per_boundary = (spines[1] - spines[0]) / steps
    points: list[tuple[float, float]] = []
    for colour, agent_id in zip(LINE_COLOURS, sorted(totals), strict=False):
        heights = line_heights(image, colour, 0, half)
        assert heights, f"no line for {agent_id} in {path}"
        for boundary in range(8, steps + 1):
            x = round(spines[0] + boundary * per_boundary)
            near = [heights[c] for c in (x - 1, x, x + 1) if c in heights]
            assert near, f"{agent_id}'s line is missing at boundary {boundary}"
            points.append((totals[agent_id][boundary - 1], sum(near) / len(near)))
    n = len(points)
    mean_v = sum(v for v, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = (sum((v - mean_v) * (y - mean_y) for v, y in points)
             / sum((v - mean_v) ** 2 for v, _ in points))
    assert slope < 0, "a larger total must be drawn higher"
    worst = max(abs(mean_y + slope * (v - mean_v) - y) for v, y in points)
    assert worst <= 3.0, f"the lines are not the exported totals (off by {worst:.1f} px)"


def test_the_synthetic_arena_view_and_plot(tmp: Path) -> None:
    gif, png = tmp / "arena.gif", tmp / "arena.png"
    code, summary, stderr = flyd_run(tmp, "--steps", "40", "--mode", "thread", "--record",
                                     str(gif), "--record-every", "4", "--plot", str(png))
    assert code == 0 and summary["state"] == "succeeded", summary
    # recording observes the run, it does not change it
    assert summary["behaviourDigest"] == clean_digest(tmp)
    frames = gif_frames(gif)
    assert len(frames) == 40 // 4
    assert {f.size for f in frames} == {(32, 24)}  # the arena view's own size
    assert all(varies(f) for f in frames)
    # the boundary marker column moves: consecutive frames differ
    assert all(a.tobytes() != b.tobytes() for a, b in itertools.pairwise(frames))
    check_png(png)
    check_plotted_lines(png, exported_totals(tmp, summary["run"]))
    assert f"--record {gif}: 10 frames of 32x24" in stderr
    assert f"--plot {png}: 40 boundaries" in stderr


@pytest.mark.parametrize("mode, kill", [("thread", "kill:plane@15"),
                                        ("process", "kill:ant-b@25")])
def test_the_reaching_example_recovered_records_each_boundary_once(tmp: Path, mode: str,
                                                                   kill: str) -> None:
    clean = reaching.clean_digest(tmp)
    gif, png = tmp / "reaching.gif", tmp / "reaching.png"
    code, summary, _ = flyd_run(tmp, "--spec", reaching.SPEC, *reaching.PLUGINS, "--steps",
                                reaching.STEPS, "--mode", mode, "--fault", kill, "--record",
                                str(gif), "--record-every", "2", "--plot", str(png))
    assert code == 0 and summary["state"] == "succeeded", summary
    assert summary["recoveries"] == 1 and summary["behaviourDigest"] == clean
    frames = gif_frames(gif)
    # boundaries stepped again after the recovery are not recorded twice
    assert len(frames) == int(reaching.STEPS) // 2
    assert {f.size for f in frames} == {(96, 96)}  # run.json's `view`
    assert all(varies(f) for f in frames)
    assert len({f.tobytes() for f in frames}) > 1  # the points move
    check_png(png)


@pytest.mark.parametrize("option", ["--record", "--plot"])
def test_an_unwritable_path_is_usage_before_anything_starts(tmp: Path, option: str) -> None:
    target = tmp / "missing-dir" / "x.out"
    code, summary, _ = flyd_run(tmp, "--steps", "5", option, str(target))
    assert code == 2
    assert summary["error"]["code"] == "USAGE"
    assert summary["error"]["message"].startswith(f"{option} {target}: cannot write")
    assert not (tmp / "state").exists(), "the node started"


@pytest.mark.parametrize("option, module", [("--record", "PIL"), ("--plot", "matplotlib")])
def test_a_missing_extra_is_usage_naming_it(tmp: Path, option: str, module: str) -> None:
    """The library hidden from `flyd run` (`sys.modules[name] = None` makes it unimportable)."""
    code = (f"import sys, runpy; sys.modules[{module!r}] = None; "
            f"sys.argv = ['flyd', 'run', '--json', '--steps', '5', {option!r}, "
            f"{str(tmp / 'x.out')!r}]; runpy.run_module('flyd', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_for(tmp),
                         capture_output=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert b"flyd[pictures]" in out.stdout and b'"code":"USAGE"' in out.stdout
    assert not (tmp / "x.out").exists()


def test_record_every_below_one_is_usage(tmp: Path) -> None:
    code, summary, _ = flyd_run(tmp, "--steps", "5", "--record", str(tmp / "x.gif"),
                                "--record-every", "0")
    assert code == 2 and summary["error"]["code"] == "USAGE"
    assert "--record-every" in summary["error"]["message"]


def frame_of(boundary: int, side: int = 64) -> Frame:
    """A frame whose pixels depend on the boundary (so each is encoded anew)."""
    row = bytes((x * 4 + boundary) & 0xFF for x in range(side * 4))
    return Frame("v", side, side, row * side)


def test_the_gif_recorder_memory_is_flat_in_the_run_length(tmp_path: Path) -> None:
    out = (tmp_path / "long.gif").open("wb")
    recorder = GifRecorder(out, every=1, delay_ms=20)
    tracemalloc.start()
    try:
        for boundary in range(1, 201):
            recorder.add(boundary, frame_of(boundary))
        gc.collect()  # Pillow's per-frame encoder leaves cyclic garbage for the collector
        early, _ = tracemalloc.get_traced_memory()
        written = out.tell()
        for boundary in range(201, 2001):
            recorder.add(boundary, frame_of(boundary))
        gc.collect()
        late, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.tell() > 5 * written  # the frames went to the file as they came
    assert late - early < 64 * 1024, (early, late)  # nothing per frame is kept
    recorder.close()
    with Image.open(tmp_path / "long.gif") as gif:
        assert gif.n_frames == 2000 and gif.size == (64, 64)


def test_the_plot_keeps_a_bounded_number_of_points() -> None:
    plot = RewardPlot()
    for boundary in range(1, 100_001):
        plot.add(BoundarySample(boundary, None, {"a": 1.0, "b": 0.5}, float(boundary)))
    for line in (*plot.rewards.values(), plot.progress):
        assert MAX_POINTS // 2 <= len(line.xs) < MAX_POINTS
        assert line.xs == sorted(line.xs)
    assert plot.totals == {"a": 100_000.0, "b": 50_000.0}
    assert plot.rewards["a"].ys[-1] == plot.rewards["a"].xs[-1]  # cumulative at its boundary


def test_a_world_without_views_gives_no_gif(tmp: Path) -> None:
    gif = tmp / "none.gif"
    code, summary, stderr = flyd_run(tmp, "--spec", reaching.SPEC, *reaching.PLUGINS,
                                     "--steps", "6", "--mode", "thread", "--world-config",
                                     '{"layoutSeed": 3}', "--record", str(gif))
    assert code == 0 and summary["state"] == "succeeded", summary
    assert not gif.exists()
    assert f"--record {gif}: no frame to record (the world declares no views" in stderr


def test_the_fly_arena_example_short_run_records_and_plots(tmp: Path) -> None:
    """The README's pictures come from this example: its top-down view (the first declared,
    64×64) as a GIF and the flies' rewards as a plot, the run unchanged by the recording."""
    gif, png = tmp / "flies.gif", tmp / "flies.png"
    code, summary, stderr = flyd_run(tmp, "--spec", fly_arena.SPEC, *fly_arena.PLUGINS,
                                     "--steps", fly_arena.STEPS, "--record", str(gif),
                                     "--record-every", "3", "--plot", str(png))
    assert code == 0 and summary["state"] == "succeeded", summary
    assert summary["behaviourDigest"] == fly_arena.clean_digest(tmp)
    frames = gif_frames(gif)
    assert len(frames) == int(fly_arena.STEPS) // 3
    assert {f.size for f in frames} == {(64, 64)}
    assert all(varies(f) for f in frames)
    assert frames[0].tobytes() != frames[-1].tobytes(), "the flies never moved"
    check_png(png)
    assert f"--plot {png}: {fly_arena.STEPS} boundaries" in stderr
