"""Step-rate benchmark: `flyd run` (process mode, two agents) against a bus-derived floor.

A lockstep transition is three sequential round trips (Prepare to every agent, Advance, Commit
to every agent; the agents' calls of one phase run concurrently), so no step rate can beat
`1 / (3 × RTT)` where RTT is the bus forwarding floor's round trip (`bench/bus.py`:
`measure_floor`, a forwarder that only decodes and re-encodes frames), measured in the same run.

Prints one JSON line:
  {"bench":"step_rate","agents":2,"mode":"process","steps":..,"steps_per_s":..,
   "floor_rtt_us":..,"floor_steps_per_s":..,"ratio":..}
`steps_per_s` is the run summary's `stepsPerSecond` (stepping time only, launch excluded);
`ratio` = steps_per_s / floor_steps_per_s, as the target states it (>= 0.6; 1.0 would be
the floor).
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
ROUND_TRIPS_PER_STEP = 3


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def bus_bench() -> ModuleType:
    """bench/bus.py by path: as a script's sibling named `bus` it would shadow the package."""
    spec = importlib.util.spec_from_file_location("bench_bus", ROOT / "bench" / "bus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_steps(tmp: str, steps: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("FLYD_SOCKET", "RUNTIME_DIRECTORY")}
    env["FLYD_LOG_FORMAT"] = "json"
    out = subprocess.run(
        [sys.executable, "-m", "flyd", "run", "--json", "-q", "--steps", str(steps), "--mode",
         "process", "--socket", os.path.join(tmp, "run.sock"), "--state-dir",
         os.path.join(tmp, "state")],
        cwd=ROOT, env=env, capture_output=True, check=True)
    summary: dict[str, Any] = orjson.loads(out.stdout)
    if summary["state"] != "succeeded":
        raise RuntimeError(f"flyd run ended {summary['state']}: {summary['failures']}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("-n", type=int, default=2000, help="floor round trips")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp")
    try:
        progress(f"floor: forwarder + echo + client, {args.n} calls")
        floor = bus_bench().measure_floor(tmp, args.n)
        progress(f"flyd run --steps {args.steps} --mode process")
        summary = run_steps(tmp, args.steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rtt = statistics.median(floor["rtts"])
    floor_rate = 1.0 / (ROUND_TRIPS_PER_STEP * rtt)
    rate = float(summary["stepsPerSecond"])
    print(orjson.dumps({"bench": "step_rate", "agents": 2, "mode": "process",
                        "steps": args.steps, "steps_per_s": round(rate, 1),
                        "floor_rtt_us": round(rtt * 1e6, 1),
                        "floor_steps_per_s": round(floor_rate, 1),
                        "ratio": round(rate / floor_rate, 3) if floor_rate > 0 else None}).decode())


if __name__ == "__main__":
    main()
