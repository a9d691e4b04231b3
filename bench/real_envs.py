"""Real-env benchmark: published Gymnasium and PettingZoo envs through flyd's adapters against
the same env in a plain loop, and flyd's overhead per step against the synthetic session's
step at the same agent count, all measured in the same run.

Per env (a MuJoCo env of one agent, MPE2's simple_spread with 2 and with 12 agents, and
PettingZoo's pistonball with 4 agents and pixel observations):

  {"bench":"real_envs","env":..,"agents":N,"plain_steps_per_s":..,"flyd_steps_per_s":..,
   "synthetic_steps_per_s":..,"overhead_ms_per_step":..,"synthetic_ms_per_step":..,
   "overhead_ratio":..,"target":1.3,
   "plain_cpu_ms_per_step":..,"flyd_cpu_ms_per_step":..,"synthetic_cpu_ms_per_step":..,
   "cpu_overhead_ratio":..}
  {"bench":"real_envs_scaling","agents":[2,12],"overhead_ms":[..,..],"ratio":..,"target":3.0,
   "cpu_overhead_ms":[..,..],"cpu_ratio":..}

- plain: the env built and stepped in this process, every agent's action drawn by the same
  `workers.adapters.pettingzoo:random_policy` the flyd run's agents use, episodes reset when
  they end (as the adapter world does), timed over `steps` steps after one warm-up episode.
- flyd: `flyd run --spec` (process mode, `--no-pace`, no checkpoints but the final one) of the
  env with `PolicyModel` agents (`--model InlinePolicyModel`: its inline variant) running that
  policy; the rate is the summary's `stepsPerSecond` (advances over the time from `Ready(0)` to
  the last boundary), so the launch, the bootstrap and the final capture stay out.
- synthetic: the same run of `flyd run --agents a1..aN` (the synthetic arena and brains) at the
  same agent count.
- `overhead_ms_per_step` = 1/flyd − 1/plain; `overhead_ratio` = overhead / (1/synthetic): the
  adapters' cost on top of the env, in units of a bare lockstep step. Targets: ≤ 1.3 per env;
  the 12-agent env's overhead ≤ 3× the 2-agent one's (`real_envs_scaling`).
- CPU: the same comparison in CPU time, which a loaded machine disturbs far less than wall
  time. A run's CPU is that of `flyd run` and every process under it (each reaped by its
  parent: `RUSAGE_CHILDREN`; PostgreSQL's own is not counted); per step it is the difference
  between a run of `steps` and one of a quarter of them, over the steps between, so the
  launch, the bootstrap and the final capture cancel out. The plain loop's is its process
  time. `cpu_overhead_ratio` = (flyd − plain) / synthetic, per step.

Runs against `FLYD_TEST_DSN`'s server (or 127.0.0.1:5432) in a database created and dropped
here. Run it as `python -P bench/real_envs.py` (needs the pettingzoo extra). Progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
POLICY = "workers.adapters.pettingzoo:random_policy"
TARGET = 1.3
SCALING_TARGET = 3.0


# bench/step_cpu.py by path (the bench runs with -P: `bench/bus.py` would shadow `bus`); it
# loads its own siblings, so that loader is written once, there.
scaling = SimpleNamespace(**runpy.run_path(str(ROOT / "bench" / "step_cpu.py"),
                                           run_name="bench_step_cpu")).scaling


@dataclass(frozen=True)
class Env:
    """One benchmarked env: its world config and how many steps each measurement takes."""

    name: str
    world: str
    env: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    agents: int = 1
    steps: int = 400


ENVS = (
    Env("InvertedPendulum-v5", "workers.adapters.gymnasium:EnvWorld", "gymnasium:make",
        {"id": "InvertedPendulum-v5"}, 1, 600),
    Env("simple_spread_v3 N=2", "workers.adapters.pettingzoo:ParallelEnvWorld",
        "mpe2.simple_spread_v3:parallel_env", {"N": 2, "max_cycles": 100}, 2, 600),
    Env("simple_spread_v3 N=12", "workers.adapters.pettingzoo:ParallelEnvWorld",
        "mpe2.simple_spread_v3:parallel_env", {"N": 12, "max_cycles": 100}, 12, 300),
    Env("pistonball_v6 n=4 (pixels)", "workers.adapters.pettingzoo:ParallelEnvWorld",
        "pettingzoo.butterfly.pistonball_v6:parallel_env", {"n_pistons": 4}, 4, 200),
)


# -------------------------------------------------------------------------------- plain loop


def plain_steps_per_s(env: Env, steps: int) -> Rate:
    """The env stepped in this process by the same policy, as the world would step it."""
    from workers.adapters.gymnasium import SingleAgentParallel
    from workers.adapters.pettingzoo import Spaces, episode_seed, load_callable, random_policy

    made = load_callable(env.env, "env")(**env.kwargs)
    parallel = made if hasattr(made, "possible_agents") else SingleAgentParallel(made)
    spaces = {a: Spaces(parallel.observation_space(a), parallel.action_space(a))
              for a in parallel.possible_agents}
    rngs = {a: np.random.default_rng(i) for i, a in enumerate(parallel.possible_agents)}
    episode = 0
    observations, _ = parallel.reset(seed=episode_seed(0, episode))

    def step() -> None:
        nonlocal observations, episode
        actions = {a: random_policy(observations[a], str(a), rngs[a], spaces[a])
                   for a in parallel.agents}
        observations, *_ = parallel.step(actions)
        if not parallel.agents:
            episode += 1
            observations, _ = parallel.reset(seed=episode_seed(0, episode))

    for _ in range(min(steps, 50)):
        step()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return Rate(steps / (time.perf_counter() - start), (time.process_time() - cpu) / steps)


# -------------------------------------------------------------------------------- flyd runs


def spec_doc(env: Env, steps: int, model: str) -> dict[str, Any]:
    return {"sessionId": "bench", "steps": steps, "seed": 7, "mode": "process",
            "agents": [{"agentId": f"a{i:02d}", "portId": f"p{i:02d}",
                        "model": f"workers.adapters.pettingzoo:{model}",
                        "modelConfig": {"policy": POLICY}} for i in range(env.agents)],
            "world": {"worldId": "env", "impl": env.world,
                      "config": {"env": env.env, "kwargs": env.kwargs}},
            "checkpoints": {"everySteps": 0}}


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's reaped descendants so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed_run(tmp: Path, dsn: str, args: list[str]) -> tuple[float, float, dict[str, Any]]:
    """One `flyd run` (process mode, unpaced): (wall seconds, CPU seconds of it and every
    process under it, summary)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    cpu = children_cpu()
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "flyd", "run", "--json", "-q", "--log-format", "json",
         "--no-pace", "--checkpoint-every", "0", "--config", str(tmp / "flyd.toml"),
         "--dsn", dsn, "--socket", str(tmp / "run.sock"), "--state-dir", str(tmp / "state"),
         "--plugin-path", str(ROOT), *args],
        cwd=ROOT, env=env, capture_output=True, check=False)
    wall = time.perf_counter() - start
    cpu = children_cpu() - cpu
    try:
        summary: dict[str, Any] = orjson.loads(out.stdout)
    except orjson.JSONDecodeError:
        raise RuntimeError(f"flyd run printed no summary (exit {out.returncode}): "
                           f"{out.stderr.decode(errors='replace')[-2000:]}") from None
    if summary.get("state") != "succeeded" or summary.get("recoveries"):
        raise RuntimeError(f"flyd run did not succeed cleanly: {summary}")
    return wall, cpu, summary


@dataclass(frozen=True)
class Rate:
    """A point's steps per second (wall) and CPU seconds per step."""

    steps_per_s: float
    cpu_per_step: float


def measure(tmp: Path, dsn: str, steps: int, make_args: Any, repeat: int) -> Rate:
    """The summary's `stepsPerSecond` (advances over the time from `Ready(0)` to the last
    boundary: the launch, the bootstrap and the final capture stay out) and the CPU per step
    (a run of `steps` less one of `steps // 4`, over the steps between), medians of `repeat`
    pairs of runs."""
    short = max(1, steps // 4)
    rates, cpus = [], []
    for _ in range(repeat):
        _, cpu_short, _ = timed_run(tmp, dsn, make_args(short))
        _, cpu_long, summary = timed_run(tmp, dsn, make_args(steps))
        rates.append(float(summary["stepsPerSecond"]))
        cpus.append((cpu_long - cpu_short) / (steps - short))
    return Rate(statistics.median(rates), statistics.median(cpus))


def flyd_args(tmp: Path, env: Env, model: str) -> Any:
    def make(steps: int) -> list[str]:
        path = tmp / f"spec-{steps}.json"
        path.write_bytes(orjson.dumps(spec_doc(env, steps, model)))
        return ["--spec", str(path)]
    return make


def synthetic_args(agents: int) -> Any:
    ids = ",".join(f"a{i}" for i in range(1, agents + 1))
    return lambda steps: ["--steps", str(steps), "--mode", "process", "--agents", ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="pairs of runs per point (median)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the step counts")
    ap.add_argument("--env", action="append", help="only the envs whose name starts so")
    ap.add_argument("--model", default="PolicyModel", choices=("PolicyModel",
                                                               "InlinePolicyModel"),
                    help="the agents' model (InlinePolicyModel: calls on the event loop)")
    args = ap.parse_args()
    envs = [e for e in ENVS if not args.env or any(e.name.startswith(p) for p in args.env)]
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp"))
    overheads: dict[int, tuple[float, float]] = {}
    synthetic: dict[int, Rate] = {}
    try:
        with scaling.scratch_database() as dsn:
            (tmp / "flyd.toml").write_text(scaling.config_text(max(e.agents for e in envs)))
            for env in envs:
                steps = max(20, int(env.steps * args.scale))
                scaling.progress(f"{env.name}: plain loop, flyd and synthetic, {steps} steps")
                plain = plain_steps_per_s(env, steps)
                flyd = measure(tmp, dsn, steps, flyd_args(tmp, env, args.model), args.repeat)
                if env.agents not in synthetic:
                    synthetic[env.agents] = measure(tmp, dsn, max(steps, 400),
                                                    synthetic_args(env.agents), args.repeat)
                bare = synthetic[env.agents]
                overhead = 1.0 / flyd.steps_per_s - 1.0 / plain.steps_per_s
                cpu_overhead = flyd.cpu_per_step - plain.cpu_per_step
                if env.name.startswith("simple_spread"):
                    overheads[env.agents] = (overhead, cpu_overhead)
                scaling.emit({
                    "bench": "real_envs", "env": env.name, "agents": env.agents,
                    "model": args.model,
                    "plain_steps_per_s": round(plain.steps_per_s, 1),
                    "flyd_steps_per_s": round(flyd.steps_per_s, 1),
                    "synthetic_steps_per_s": round(bare.steps_per_s, 1),
                    "overhead_ms_per_step": round(1000 * overhead, 3),
                    "synthetic_ms_per_step": round(1000 / bare.steps_per_s, 3),
                    "overhead_ratio": round(overhead * bare.steps_per_s, 3), "target": TARGET,
                    "plain_cpu_ms_per_step": round(1000 * plain.cpu_per_step, 3),
                    "flyd_cpu_ms_per_step": round(1000 * flyd.cpu_per_step, 3),
                    "synthetic_cpu_ms_per_step": round(1000 * bare.cpu_per_step, 3),
                    "cpu_overhead_ratio": round(cpu_overhead / bare.cpu_per_step, 3)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if 2 in overheads and 12 in overheads:
        (wall_2, cpu_2), (wall_12, cpu_12) = overheads[2], overheads[12]
        scaling.emit({"bench": "real_envs_scaling", "agents": [2, 12],
                      "overhead_ms": [round(1000 * wall_2, 3), round(1000 * wall_12, 3)],
                      "ratio": round(wall_12 / wall_2, 3), "target": SCALING_TARGET,
                      "cpu_overhead_ms": [round(1000 * cpu_2, 3), round(1000 * cpu_12, 3)],
                      "cpu_ratio": round(cpu_12 / cpu_2, 3)})


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the bench runs with -P; the adapters are imported from here
    importlib.invalidate_caches()
    main()
