"""A stopped watcher does not slow a run: `flyd run` steps/s alone, with a live `flyctl watch`,
and with a watcher SIGSTOPped after its first line, in rotated rounds of one sitting.

tests/cli/test_watch.py asserts the mechanism (one latest slot, nothing queued while the
watcher is stopped); the speed is measured here, where a ratio against the same run unwatched
in the same sitting cancels the machine's load.

Prints one JSON line:
  {"bench":"watch","steps":..,"rounds":..,"alone_steps_per_s":..,"live_steps_per_s":..,
   "stopped_steps_per_s":..,"live_ratio":..,"stopped_ratio":..}
each steps/s the median over the rounds of the run summary's `stepsPerSecond`; a ratio is the
watched median over the unwatched one (1.0: no cost). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
WATCHER_WAIT_S = 30.0


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLYD_SOCKET", "RUNTIME_DIRECTORY", "FLYD_CONFIG")}
    env["FLYD_LOG_FORMAT"] = "json"
    return env


def start_watcher(socket: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`flyctl watch` once the run's node answers; returns after its first boundary line."""
    deadline = time.monotonic() + WATCHER_WAIT_S
    while True:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from flyd.cli.flyd import flyctl_main; flyctl_main()",
             "watch", "--json", "--socket", socket],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        if proc.stdout.readline():
            return proc
        proc.wait()
        if time.monotonic() > deadline:
            raise RuntimeError("flyctl watch found no run within 30 s")
        time.sleep(0.1)


def one_run(steps: int, watch: str) -> float:
    """One `flyd run` in process mode; `watch` is alone, live or stopped."""
    env = environment()
    with tempfile.TemporaryDirectory(prefix="flyd-bench-watch-") as tmp:
        socket = os.path.join(tmp, "run.sock")
        run = subprocess.Popen(
            [sys.executable, "-m", "flyd", "run", "--json", "-q", "--steps", str(steps),
             "--no-pace", "--mode", "process", "--socket", socket, "--state-dir",
             os.path.join(tmp, "state")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        watcher = None if watch == "alone" else start_watcher(socket, env)
        try:
            if watcher is not None and watch == "stopped":
                os.kill(watcher.pid, signal.SIGSTOP)
            out, _ = run.communicate(timeout=600)
        finally:
            if watcher is not None:
                watcher.kill()
                watcher.wait()
        summary: dict[str, Any] = orjson.loads(out)
        if summary["state"] != "succeeded":
            raise RuntimeError(f"flyd run ended {summary['state']}: {summary['failures']}")
        return float(summary["stepsPerSecond"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kinds = ["alone", "live", "stopped"]
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_no in range(args.rounds):
        order = kinds[round_no % 3:] + kinds[:round_no % 3]
        for kind in order:
            rate = one_run(args.steps, kind)
            rates[kind].append(rate)
            progress(f"round {round_no + 1}/{args.rounds} {kind}: {rate:.1f} steps/s")
    median = {kind: statistics.median(values) for kind, values in rates.items()}
    print(orjson.dumps({
        "bench": "watch", "steps": args.steps, "rounds": args.rounds,
        "alone_steps_per_s": median["alone"], "live_steps_per_s": median["live"],
        "stopped_steps_per_s": median["stopped"],
        "live_ratio": round(median["live"] / median["alone"], 3),
        "stopped_ratio": round(median["stopped"] / median["alone"], 3),
    }).decode())


if __name__ == "__main__":
    main()
