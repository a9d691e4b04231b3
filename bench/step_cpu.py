"""Step-CPU benchmark: CPU per lockstep step of `flyd run` (process mode), summed over the node,
the router and every worker, for 2, 8 and 32 agents at checkpoint cadence 0 and 60.

Each point is two `flyd run --no-pace --mode process --checkpoint-every C` runs of different
lengths (short and long); CPU is the user + system time of the whole process tree (the bench's
`RUSAGE_CHILDREN` across the run: the node reaps its router and workers, so their time is
included), and the figure is the difference of the two runs' CPU over the difference of their
advances, so launch, bootstrap and teardown cancel. `--repeat` pairs give a median; a pair in
which a run recovered (a lease lost on a loaded host) is discarded and run again. Prints one
JSON line per point:

  {"bench":"step_cpu","agents":N,"mode":"process","agents_per_process":K,"cadence":C,
   "cpu_ms_per_step":..,
   "per_added_agent_ms":..,"steps":[short,long],"pairs":[..],"discarded":..}

`per_added_agent_ms` = (cpu(N) - cpu(2)) / (N - 2) at the same cadence (null at N = 2). Targets
(issue 16): cpu_ms_per_step <= 1.6 at 2 agents, per_added_agent_ms <= 0.5; with
`--agents-per-process 8` (agent hosts), per_added_agent_ms <= 0.3.

Decisions:
- The database is a scratch one on `FLYD_TEST_DSN`'s server (or 127.0.0.1:5432), not the
  embedded server, so PostgreSQL's own CPU (not node, router or workers) stays out of the sum.
- A run that ends failed after its last step (e.g. a final capture refused) still counts: the
  figure uses the advances each run made. A long run that stops short of its steps measures more
  than stepping: its point is printed with `cpu_ms_per_step` null and the failure as `limit`.

Run it as `python -P bench/step_cpu.py`. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
AGENTS = (2, 8, 32)
CADENCES = (0, 60)
BASE_AGENTS = 2


def sibling(name: str) -> ModuleType:
    """bench/<name>.py by path (the bench runs with -P: `bench/bus.py` would shadow `bus`)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scaling = sibling("agent_scaling")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_cpu(tmp: Path, dsn: str, agents: int, cadence: int, steps: int,
            extra: Sequence[str] = ()) -> tuple[float, int, dict[str, Any]]:
    """One `flyd run` (`extra`: more of its options): (CPU seconds of its whole tree, advances,
    summary)."""
    ids = ",".join(f"a{i}" for i in range(1, agents + 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    before = children_cpu()
    out = subprocess.run(
        [sys.executable, "-m", "flyd", "run", "--json", "-q", "--log-format", "json", "--steps",
         str(steps), "--checkpoint-every", str(cadence), "--no-pace", "--mode", "process",
         "--agents", ids, "--config", str(tmp / "flyd.toml"), "--dsn", dsn, "--socket",
         str(tmp / "run.sock"), "--state-dir", str(tmp / "state"), *extra],
        cwd=ROOT, env=env, capture_output=True, check=False)
    cpu = children_cpu() - before
    try:
        summary: dict[str, Any] = orjson.loads(out.stdout)
    except orjson.JSONDecodeError:
        raise RuntimeError(f"flyd run printed no summary (exit {out.returncode}): "
                           f"{out.stderr.decode(errors='replace')[-2000:]}") from None
    return cpu, int(summary["advances"]), summary


def limit_of(summary: dict[str, Any]) -> str | None:
    """Why a run stopped short: its first failure's code and message, or None."""
    if summary["state"] == "succeeded":
        return None
    failures = summary.get("failures") or [{}]
    first = failures[0]
    return f"{first.get('code')}: {first.get('message')}" if first else summary["state"]


def recovered(summary: dict[str, Any]) -> bool:
    """Whether the run recovered (a lease lost on a loaded host, a restore): its CPU is not the
    stepping's alone."""
    return int(summary.get("recoveries", 0)) > 0 or len(summary.get("epochs") or ()) > 1


def point(tmp: Path, dsn: str, agents: int, cadence: int, short: int, long: int,
          repeat: int) -> dict[str, Any]:
    """`repeat` pairs (a pair with a recovery is run again, at most `repeat` times more)."""
    pairs: list[float] = []
    limit: str | None = None
    discarded = 0
    while len(pairs) < repeat and discarded <= repeat:
        cpu_s, adv_s, sum_s = run_cpu(tmp, dsn, agents, cadence, short)
        cpu_l, adv_l, sum_l = run_cpu(tmp, dsn, agents, cadence, long)
        limit = limit_of(sum_l) or limit_of(sum_s)
        if adv_l - adv_s <= 0:
            break
        if recovered(sum_s) or recovered(sum_l):
            discarded += 1
            continue
        if adv_l < long:  # stopped short: the difference is not stepping alone
            if limit is None:
                raise RuntimeError(f"{agents} agents: the long run made {adv_l}/{long} advances")
            break
        pairs.append(1000.0 * (cpu_l - cpu_s) / (adv_l - adv_s))
    return {"agents": agents, "cadence": cadence, "steps": [short, long],
            "cpu_ms_per_step": statistics.median(pairs) if pairs else None,
            "pairs": [round(p, 3) for p in pairs], "discarded": discarded,
            "limit": None if pairs else limit}


def lengths(agents: int, scale: float) -> tuple[int, int]:
    """Short and long run lengths: about the same CPU per point whatever the agent count."""
    long = max(200, int(scale * 2400 / (1 + agents / 4)))
    return long // 4, long


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, nargs="+", default=list(AGENTS))
    ap.add_argument("--cadence", type=int, nargs="+", default=list(CADENCES))
    ap.add_argument("--repeat", type=int, default=1, help="pairs of runs per point (median)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the run lengths")
    ap.add_argument("--agents-per-process", type=int, default=1,
                    help="agents per worker process (agent hosts; 1: one process per agent)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp"))
    try:
        with scaling.scratch_database() as dsn:
            (tmp / "flyd.toml").write_text(scaling.config_text(max(args.agents),
                                                               args.agents_per_process))
            for cadence in args.cadence:
                base: float | None = None
                for agents in sorted(args.agents):
                    short, long = lengths(agents, args.scale)
                    scaling.progress(f"{agents} agents, cadence {cadence}: {short} and {long} "
                                     f"steps x {args.repeat}")
                    got = point(tmp, dsn, agents, cadence, short, long, args.repeat)
                    cpu = got["cpu_ms_per_step"]
                    if agents == BASE_AGENTS:
                        base = cpu
                    added = None if cpu is None or base is None or agents == BASE_AGENTS else \
                        round((cpu - base) / (agents - BASE_AGENTS), 3)
                    line = {"bench": "step_cpu", "agents": agents, "mode": "process",
                            "agents_per_process": args.agents_per_process, "cadence": cadence,
                            "cpu_ms_per_step": None if cpu is None else round(cpu, 3),
                            "per_added_agent_ms": added, "steps": got["steps"],
                            "pairs": got["pairs"], "discarded": got["discarded"]}
                    if got["limit"] is not None:
                        line["limit"] = got["limit"]
                    scaling.emit(line)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
