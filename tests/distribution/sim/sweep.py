"""The tier-1 seed sweep, canary hunt and single-seed replay (distribution.md §7.2, §7.3.7).

Rules:
- `sweep(seeds)` judges every seed in a process pool (fork; `workers` processes, 2 by default
  on this suite's 2-core budget, at most 4) and prints `[sim] seeds a..b: ok, failed, seconds,
  seeds/s` after every 100 seeds. Results come back in seed order, so the lines and the
  aggregate are the same on every run.
- Aggregate non-vacuity (`NON_VACUITY`): the share of seeds whose history shows each fact.
- A failing seed writes its record (seed, parameters, schedule, verdicts with evidence, tables,
  node events, taps) to `<FLYD_FAULT_ARTIFACTS or .faults>/sim-<variant>-<seed>.json` and prints
  the re-run command; `python -m tests.distribution.oracle <record>` re-judges it offline.
- `FLYD_SIM_SEEDS` sizes the sweep (default 1000); `FLYD_SIM_SEED=<n>` replays one seed with its
  full trace (`python -m tests.distribution.sim --seed <n>`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tests.distribution.oracle import judge, render

from .canaries import variant
from .world import digest, quiet_unawaited, run_seed

NON_VACUITY: Final = {"reclaim": 0.20, "db_fenced": 0.05, "self_fence": 0.05,
                      "unknown_commit": 0.05}
PROGRESS_EVERY: Final = 100
DEFAULT_SEEDS: Final = 1000


def seed_count() -> int:
    return int(os.environ.get("FLYD_SIM_SEEDS", str(DEFAULT_SEEDS)))


def artifacts_dir() -> Path:
    return Path(os.environ.get("FLYD_FAULT_ARTIFACTS", ".faults"))


def rerun_command(seed: int, kind: str, variant_name: str) -> str:
    if kind == "mixed" and variant_name == "real":
        return (f"FLYD_SIM_SEED={seed} pytest tests/distribution/test_sim.py -q "
                f"-k test_sim_replay_from_env")
    return (f"python -m tests.distribution.sim --seed {seed} --kind {kind} "
            f"--variant {variant_name}")


@dataclass
class SeedResult:
    seed: int
    ok: bool
    digest: str
    facts: dict[str, int]
    failures: list[str] = field(default_factory=list)
    record_path: str | None = None


def judge_seed(seed: int, kind: str = "mixed", variant_name: str = "real",
               vacuity: Sequence[str] = ()) -> SeedResult:
    """Simulate and judge one seed; a failure writes its record (see the module rules)."""
    try:
        record = run_seed(seed, kind, variant(variant_name))
    except Exception as exc:  # a simulator crash fails the seed; replay shows the traceback
        return SeedResult(seed, False, "", {}, [f"simulator error: {exc!r}"])
    j = judge(record, vacuity)
    result = SeedResult(seed, j.ok, digest(record), j.facts,
                        [f"{v.check}: {v.evidence[0] if v.evidence else ''}"
                         for v in j.failures()])
    if not j.ok:
        record["verdicts"] = j.as_dict()
        record["vacuity"] = list(vacuity)
        record["rerun"] = rerun_command(seed, kind, variant_name)
        out = artifacts_dir() / f"sim-{variant_name}-{kind}-{seed}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=None), encoding="utf-8")
        result.record_path = str(out)
    return result


def _job(args: tuple[int, str, str, tuple[str, ...]]) -> SeedResult:
    return judge_seed(*args)


@dataclass
class SweepResult:
    results: list[SeedResult]
    seconds: float

    @property
    def failed(self) -> list[SeedResult]:
        return [r for r in self.results if not r.ok]

    def share(self, fact: str) -> float:
        return sum(1 for r in self.results if r.facts.get(fact, 0) > 0) / max(1, len(
            self.results))

    def vacuity_problems(self) -> list[str]:
        return [f"{fact}: {self.share(fact):.1%} of seeds < {need:.0%}"
                for fact, need in NON_VACUITY.items() if self.share(fact) < need]

    def fact_counts(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for r in self.results:
            c.update(k for k, n in r.facts.items() if n > 0)
        return c


def _pool(workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=max(1, min(4, workers)),
                               mp_context=multiprocessing.get_context("fork"),
                               initializer=quiet_unawaited)


def sweep(seeds: Iterable[int], *, kind: str = "mixed", variant_name: str = "real",
          workers: int = 2, vacuity: Sequence[str] = (),
          progress: Callable[[str], None] = print, stop_on_failure: bool = False,
          chunk: int = 8) -> SweepResult:
    """Judge `seeds` in a process pool, in order (see the module rules)."""
    todo = list(seeds)
    start = time.monotonic()
    results: list[SeedResult] = []
    block_start = time.monotonic()
    with _pool(workers) as pool:
        jobs = [(s, kind, variant_name, tuple(vacuity)) for s in todo]
        step = PROGRESS_EVERY if not stop_on_failure else max(chunk * workers, 1)
        for i in range(0, len(jobs), step):
            block = list(pool.map(_job, jobs[i:i + step], chunksize=chunk))
            results.extend(block)
            if len(results) % PROGRESS_EVERY == 0 or len(results) == len(jobs):
                now = time.monotonic()
                first = results[-1].seed - (len(results) - 1) % PROGRESS_EVERY
                done = (len(results) - 1) % PROGRESS_EVERY + 1
                secs = now - block_start
                bad = sum(1 for r in results[-done:] if not r.ok)
                progress(f"[sim] seeds {first}..{results[-1].seed}: ok {done - bad}, "
                         f"failed {bad}, {secs:.1f} s, {done / max(secs, 1e-9):.1f} seeds/s")
                block_start = now
            if stop_on_failure and any(not r.ok for r in block):
                break
    return SweepResult(results, time.monotonic() - start)


def replay(seed: int, kind: str = "mixed", variant_name: str = "real",
           out: Callable[[str], None] = print) -> SeedResult:
    """Run one seed and print its full trace, its verdicts and its digest."""
    record = run_seed(seed, kind, variant(variant_name))
    out(f"[sim] replay seed={seed} kind={kind} variant={variant_name}")
    for f in record["log"]["schedule"]:
        out(f"[sim] fault {json.dumps(f, sort_keys=True)}")
    for ev in record["events"]:
        out("[sim] " + json.dumps(ev, sort_keys=True))
    j = judge(record)
    out(render(j))
    d = digest(record)
    out(f"[sim] digest {d}")
    return SeedResult(seed, j.ok, d, j.facts, [v.check for v in j.failures()])


def summary(result: SweepResult) -> dict[str, Any]:
    return {"seeds": len(result.results), "failed": [r.seed for r in result.failed],
            "seconds": round(result.seconds, 2),
            "shares": {k: round(result.share(k), 3) for k in NON_VACUITY}}
