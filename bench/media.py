"""Media benchmark: steps/s and CPU per step of `flyd run` with large views against small ones.

The counter arena's frame size is world configuration (`{"width": W, "height": H}`), so the
same composition runs with W×H views (default 256×256, 256 KiB a frame) and with the default
32×24 (3 KiB): 8 agents in process mode, checkpoint cadence 0, `--no-pace`. A view above
`[session] media_inline_max_bytes` (16 KiB) travels by reference, as a sealed artifact of the
router's store attached to the Advance reply and to each agent's Commit (docs/topics.md §14.2);
a smaller one inline as base64; the final checkpoint carries the bytes either way. The line says
what large media cost the lockstep:

  {"bench":"media","width":W,"height":H,"agents":N,"steps_per_s":..,"small_steps_per_s":..,
   "ratio":..,"cpu_ms_per_step":..,"small_cpu_ms_per_step":..,"pairs":[[large,small],..]}

`ratio` = steps_per_s / small_steps_per_s. Steps/s is the run's `stepsPerSecond` (stepping
only, launch excluded); CPU per step is `bench/step_cpu.py`'s: the whole process tree's CPU
over a short and a long run, differenced, so launch, bootstrap and teardown cancel. The two
sizes alternate within each of `--repeat` pairs on this shared host and the figures are medians
of the pairs; a pair in which a run recovered is discarded and run again (at most `--repeat`
times more).

Run it as `python -P bench/media.py`. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import runpy
import shutil
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
AGENTS = 8
LARGE = (256, 256)
SMALL = (32, 24)

# bench/step_cpu.py by path (the bench runs with -P: `bench/bus.py` would shadow `bus`): its
# run, CPU and length helpers are the ones every stepping bench uses.
step_cpu = SimpleNamespace(**runpy.run_path(str(ROOT / "bench" / "step_cpu.py"),
                                            run_name="bench_step_cpu"))
scaling = step_cpu.scaling


def world_config(size: tuple[int, int]) -> list[str]:
    return ["--world-config", orjson.dumps({"width": size[0], "height": size[1]}).decode()]


def measure(tmp: Path, dsn: str, agents: int, size: tuple[int, int], short: int,
            long: int) -> tuple[float, float] | None:
    """(steps/s of the long run, CPU ms per step) of one size, or None when a run recovered."""
    extra = world_config(size)
    cpu_s, adv_s, sum_s = step_cpu.run_cpu(tmp, dsn, agents, 0, short, extra)
    cpu_l, adv_l, sum_l = step_cpu.run_cpu(tmp, dsn, agents, 0, long, extra)
    if step_cpu.recovered(sum_s) or step_cpu.recovered(sum_l):
        return None
    for steps, advances, summary in ((short, adv_s, sum_s), (long, adv_l, sum_l)):
        if advances != steps:
            raise RuntimeError(f"{size[0]}x{size[1]} views: {advances}/{steps} advances: "
                               f"{step_cpu.limit_of(summary)}")
    return float(sum_l["stepsPerSecond"]), 1000.0 * (cpu_l - cpu_s) / (adv_l - adv_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=AGENTS)
    ap.add_argument("--width", type=int, default=LARGE[0])
    ap.add_argument("--height", type=int, default=LARGE[1])
    ap.add_argument("--repeat", type=int, default=3, help="(large, small) pairs (median)")
    ap.add_argument("--scale", type=float, default=0.5, help="multiplies the run lengths")
    args = ap.parse_args()
    large = (args.width, args.height)
    short, long = step_cpu.lengths(args.agents, args.scale)
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp"))
    pairs: list[tuple[tuple[float, float], tuple[float, float]]] = []
    discarded = 0
    try:
        with scaling.scratch_database() as dsn:
            (tmp / "flyd.toml").write_text(scaling.config_text(args.agents))
            while len(pairs) < args.repeat and discarded <= args.repeat:
                got: dict[tuple[int, int], tuple[float, float] | None] = {}
                # alternate which size goes first, so neither always runs on a warmer host
                order = (large, SMALL) if len(pairs) % 2 == 0 else (SMALL, large)
                for size in order:
                    scaling.progress(f"{args.agents} agents, {size[0]}x{size[1]} views: "
                                     f"{short} and {long} steps")
                    got[size] = measure(tmp, dsn, args.agents, size, short, long)
                big, small = got[large], got[SMALL]
                if big is None or small is None:
                    discarded += 1
                    continue
                pairs.append((big, small))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not pairs:
        raise RuntimeError(f"every pair recovered ({discarded} discarded)")
    rate = statistics.median(p[0][0] for p in pairs)
    small_rate = statistics.median(p[1][0] for p in pairs)
    line: dict[str, Any] = {
        "bench": "media", "width": large[0], "height": large[1], "agents": args.agents,
        "steps_per_s": round(rate, 1), "small_steps_per_s": round(small_rate, 1),
        "ratio": round(statistics.median(p[0][0] / p[1][0] for p in pairs), 3),
        "cpu_ms_per_step": round(statistics.median(p[0][1] for p in pairs), 2),
        "small_cpu_ms_per_step": round(statistics.median(p[1][1] for p in pairs), 2),
        "steps": [short, long],
        "pairs": [[round(b[0], 1), round(s[0], 1)] for b, s in pairs], "discarded": discarded}
    scaling.emit(line)


if __name__ == "__main__":
    main()
