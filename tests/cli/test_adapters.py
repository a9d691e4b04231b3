"""The PettingZoo and Gymnasium adapters end to end (docs/adapters.md): a PettingZoo
`ParallelEnv` of this tree (`tests.cli.adapter_envs:LineEnv`) runs as the world
(`ParallelEnvWorld`) with `PolicyModel` agents through `flyd run --spec` in process and thread
mode, and a killed agent or world is recovered with the behaviour digest of an undisturbed run;
a Gymnasium single-agent `Env` runs as a world of one agent, and its end ends the episode.

The repository root is named by `--plugin-path`, so the node and every worker it starts import
the tests' environments and policies from there.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.cli.test_flyctl_runs import FLYCTL
from tests.cli.test_run import ROOT, env_for, flyd_run
from tests.cli.test_run import tmp as tmp
from tests.cli.test_wide_runs import events

pytestmark = pytest.mark.timeout(180)

PLUGINS = ("--plugin-path", str(ROOT))
ENVS = "tests.cli.adapter_envs"
_CLEAN: dict[str, str] = {}


def line_spec(tmp: Path, **world: Any) -> str:
    """Two walkers on a line, one policy a function and one a callable object with state."""
    doc = {
        "sessionId": "line", "steps": "40", "seed": "7",
        "agents": [
            {"agentId": "walker-a", "portId": "p1",
             "model": "workers.adapters.pettingzoo:PolicyModel",
             "modelConfig": {"policy": f"{ENVS}:walk"}},
            {"agentId": "walker-b", "portId": "p2",
             "model": "workers.adapters.pettingzoo:PolicyModel",
             "modelConfig": {"policy": f"{ENVS}:stubborn"}}],
        "world": {"worldId": "line", "impl": "workers.adapters.pettingzoo:ParallelEnvWorld",
                  "config": {"env": f"{ENVS}:LineEnv", "kwargs": {"size": 16},
                             "render": True, "seed": 3, "episodes": 1, **world}},
        "task": {"impl": "workers.adapters.pettingzoo:EnvTask", "config": {},
                 "terminal": "never"},
        "checkpoints": {"everySteps": 5},
    }
    path = tmp / "line.json"
    path.write_text(json.dumps(doc))
    return str(path)


def slide_spec(tmp: Path) -> str:
    """One agent on a Gymnasium env with a Box action; the episode ends with the env."""
    doc = {
        "sessionId": "slide", "steps": "30", "seed": "5",
        "agents": [{"agentId": "slider", "portId": "p1",
                    "model": "workers.adapters.pettingzoo:PolicyModel",
                    "modelConfig": {"policy": f"{ENVS}:slide"}}],
        "world": {"worldId": "track", "impl": "workers.adapters.gymnasium:EnvWorld",
                  "config": {"env": f"{ENVS}:SlideEnv", "render": True, "seed": 11,
                             "episodes": 1}},
        "task": {"impl": "workers.adapters.pettingzoo:EnvTask", "config": {},
                 "terminal": "done"},
        "checkpoints": {"everySteps": 3},
    }
    path = tmp / "slide.json"
    path.write_text(json.dumps(doc))
    return str(path)


def clean(tmp: Path, name: str) -> dict[str, Any]:
    spec = line_spec(tmp) if name == "line" else slide_spec(tmp)
    code, summary, _ = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "thread")
    assert code == 0 and summary["state"] == "succeeded", summary
    assert summary["recoveries"] == 0 and summary["epochs"] == ["e1"]
    return summary


def clean_digest(tmp: Path, name: str) -> str:
    if name not in _CLEAN:
        _CLEAN[name] = clean(tmp, name)["behaviourDigest"]
    return _CLEAN[name]


def test_a_parallel_env_runs_to_its_end_and_on(tmp: Path) -> None:
    summary = clean(tmp, "line")
    _CLEAN.setdefault("line", summary["behaviourDigest"])
    # terminal never: the run goes on for its 40 steps after both walkers arrived (the env's
    # steps are the counter), with every step's frame rendered and checkpoints taken
    assert summary["boundary"] == summary["steps"] == 40
    assert 0 < summary["counter"] < 40
    assert summary["checkpoints"] >= 2  # hot ones (a busy writer defers some) and the final
    assert sorted(w["workerId"] for w in summary["workers"]) == ["line", "walker-a", "walker-b"]


@pytest.mark.parametrize("mode, kill", [("process", "kill:walker-b@12"),
                                        ("thread", "kill:line@17")])
def test_a_parallel_env_recovers_a_killed_worker_with_the_clean_digest(
        tmp: Path, mode: str, kill: str) -> None:
    digest = clean_digest(tmp, "line")
    code, summary, _ = flyd_run(tmp, "--spec", line_spec(tmp), *PLUGINS, "--mode", mode,
                                "--fault", kill)
    assert code == 0, summary
    assert summary["state"] == "succeeded" and summary["mode"] == mode
    assert summary["recoveries"] == 1 and summary["epochs"] == ["e1", "e2"], summary
    assert [f["participant"] for f in summary["failures"]] == [kill[5:].partition("@")[0]]
    assert summary["behaviourDigest"] == digest


def test_a_gymnasium_env_is_a_world_of_one_agent_and_its_end_ends_the_episode(
        tmp: Path) -> None:
    summary = clean(tmp, "slide")
    _CLEAN.setdefault("slide", summary["behaviourDigest"])
    assert 0 < summary["boundary"] < 30, "the slider never reached its target"
    assert summary["counter"] == summary["boundary"]
    code, killed, _ = flyd_run(tmp, "--spec", slide_spec(tmp), *PLUGINS, "--mode", "process",
                               "--fault", f"kill:track@{summary['boundary'] - 2}")
    assert code == 0 and killed["state"] == "succeeded", killed
    assert killed["recoveries"] == 1 and killed["boundary"] == summary["boundary"]
    assert killed["behaviourDigest"] == summary["behaviourDigest"]


# --------------------------------------------------------------------------------------------
# exact recovery of published envs, compared by export (docs/adapters.md, "Checkpoints")

_EXPORTS: dict[str, list[dict[str, Any]]] = {}


def export(tmp: Path, run: int) -> list[dict[str, Any]]:
    """`flyctl runs export RUN`: one result line per committed boundary."""
    out = subprocess.run([*FLYCTL, "runs", "export", str(run)], cwd=ROOT, env=env_for(tmp),
                         capture_output=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [orjson.loads(line) for line in out.stdout.splitlines()]


def env_spec(tmp: Path, name: str, agents: list[tuple[str, str]], world: dict[str, Any],
             steps: int) -> str:
    """A spec of the adapters: `agents` are `(agentId, policy)`, one port each, in order."""
    doc = {
        "sessionId": name, "steps": str(steps), "seed": "7",
        "agents": [{"agentId": agent, "portId": f"p{i + 1}",
                    "model": "workers.adapters.pettingzoo:PolicyModel",
                    "modelConfig": {"policy": policy}} for i, (agent, policy) in
                   enumerate(agents)],
        "world": {"worldId": name, **world},
        "task": {"impl": "workers.adapters.pettingzoo:EnvTask", "config": {},
                 "terminal": "never"},
        "checkpoints": {"everySteps": 4},
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(doc))
    return str(path)


PARALLEL = "workers.adapters.pettingzoo:ParallelEnvWorld"
#: the kill's step: after the checkpoints of boundaries 4, 8 and 12 (`everySteps` 4), so one of
#: them has committed even on a loaded machine
KILL_AT = 13
# The published envs restore from snapshots only (`restore: snapshot`): the default `auto`
# would replay an env whose snapshot does not continue, which would hide a pickle that lost
# state (a plain pickle of these envs is a fresh env: the test fails with it).
SPECS: dict[str, tuple[list[tuple[str, str]], dict[str, Any], int]] = {
    # MuJoCo (gymnasium[mujoco]): InvertedPendulumEnv inherits EzPickle
    "pole": ([("balancer", f"{ENVS}:balance")],
             {"impl": "workers.adapters.gymnasium:EnvWorld",
              "config": {"env": "gymnasium:make", "kwargs": {"id": "InvertedPendulum-v5"},
                         "seed": 3, "restore": "snapshot"}}, 24),
    # PettingZoo's sisl pursuit: 8 pursuers; its raw_env inherits EzPickle
    "pursuit": ([(f"pursuer-{i}", f"{ENVS}:roam") for i in range(8)],
                {"impl": PARALLEL,
                 "config": {"env": "pettingzoo.sisl.pursuit_v5:parallel_env",
                            "kwargs": {"max_cycles": 100}, "seed": 5,
                            "restore": "snapshot"}}, 16),
    # PettingZoo's butterfly pistonball: each piston observes its own 457x120x3 picture (sent
    # as a binary array by reference); its raw_env inherits EzPickle but holds pygame surfaces
    # that cannot be pickled, so the default `auto` recovers it by replay
    "pistons": ([(f"piston-{i}", f"{ENVS}:pistons") for i in range(4)],
                {"impl": PARALLEL,
                 "config": {"env": "pettingzoo.butterfly.pistonball_v6:parallel_env",
                            "kwargs": {"n_pistons": 4}, "seed": 1}}, 16),
    # an env whose snapshot restores differently in another process: the default `auto`
    # trusts it in-process, sees the difference in its render at the restore, and replays
    "homesick": ([("walker-a", f"{ENVS}:walk"), ("walker-b", f"{ENVS}:walk")],
                 {"impl": PARALLEL, "config": {"env": f"{ENVS}:HomesickLineEnv",
                                               "render": True, "seed": 3}}, 20),
    # an env that cannot be pickled: recovered by replay in the default `auto`
    "unpicklable": ([("walker-a", f"{ENVS}:walk"), ("walker-b", f"{ENVS}:walk")],
                    {"impl": PARALLEL, "config": {"env": f"{ENVS}:UnpicklableLineEnv",
                                                  "seed": 3}}, 20),
}


def exported_run(tmp: Path, name: str, *args: str
                 ) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    agents, world, steps = SPECS[name]
    config = tmp / "wide.toml"
    config.write_text(f"[session]\nmax_agents = {max(4, len(agents))}\n")
    code, summary, err = flyd_run(tmp, "--spec", env_spec(tmp, name, agents, world, steps),
                                  *PLUGINS, "--mode", "process", "--config", str(config),
                                  *args, timeout=150)
    assert code == 0 and summary["state"] == "succeeded", (summary["failures"], summary["outcome"])
    assert summary["boundary"] == steps
    return summary, export(tmp, summary["run"]), err


def undisturbed_export(tmp: Path, name: str) -> list[dict[str, Any]]:
    if name not in _EXPORTS:
        summary, lines, _ = exported_run(tmp, name)
        assert summary["recoveries"] == 0
        _EXPORTS[name] = lines
    return _EXPORTS[name]


def observation_digests(line: dict[str, Any]) -> dict[str, str]:
    return {e["agentId"]: e["payload"]["value"]["observationDigest"] for e in line["events"]
            if e["kindId"] == "adapter.reward"}


@pytest.mark.parametrize("name, victim", [
    ("pole", "pole"), ("pole", "balancer"), ("pursuit", "pursuit"), ("pursuit", "pursuer-3"),
    ("pistons", "pistons"), ("pistons", "piston-2"),
    ("unpicklable", "unpicklable"), ("homesick", "homesick")])
def test_a_published_env_killed_mid_run_exports_the_lines_of_an_undisturbed_run(
        tmp: Path, name: str, victim: str) -> None:
    clean = undisturbed_export(tmp, name)
    summary, lines, err = exported_run(tmp, name, "--fault", f"kill:{victim}@{KILL_AT}")
    # the fault happened: one recovery, after the named worker was lost, from a checkpoint
    assert summary["recoveries"] == 1 and summary["epochs"] == ["e1", "e2"], summary
    assert [f["participant"] for f in summary["failures"]] == [victim]
    (resumed,) = events(err, "recovery.resumed")
    assert 0 < int(str(resumed["boundary"])) <= KILL_AT, "not restored from a checkpoint"
    assert len(lines) == len(clean) == SPECS[name][2]
    for mine, theirs in zip(lines, clean, strict=True):
        assert mine["rewards"] == theirs["rewards"], mine["boundary"]
        assert observation_digests(mine) == observation_digests(theirs), mine["boundary"]
        assert mine == theirs
    # not a vacuous comparison: what the agents observed and earned changed along the run
    # (pistonball's pictures change slowly: its pistons' rewards change every step)
    seen = {(str(observation_digests(line)), str(line["rewards"])) for line in clean}
    assert len(seen) > len(clean) // 2
    assert len({str(observation_digests(line)) for line in clean}) > 1


def test_an_env_that_diverges_across_restore_ends_restore_diverged(tmp: Path) -> None:
    """`restore: snapshot` trusts the pickle; the restored world reports what it renders and
    the coordinator finds it differs from the checkpoint's record (`auto` replays this env:
    the test above)."""
    spec = env_spec(tmp, "drift", [("walker-a", f"{ENVS}:walk"), ("walker-b", f"{ENVS}:walk")],
                    {"impl": PARALLEL, "config": {"env": f"{ENVS}:HomesickLineEnv",
                                                  "render": True, "restore": "snapshot",
                                                  "seed": 3}}, 20)
    code, summary, _ = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "process",
                                "--fault", f"kill:drift@{KILL_AT}")
    assert code != 0 and summary["state"] == "failed", summary
    assert summary["failures"][0]["participant"] == "drift"  # the kill happened
    failure = summary["failures"][-1]
    assert failure["code"] == "RESTORE_DIVERGED" and failure["participant"] == "drift", summary


def test_an_env_that_replays_differently_ends_restore_diverged_naming_the_world(tmp: Path) -> None:
    """Its walkers slip by the process-wide `random`: every new process's replay differs from
    the record (`RESTORE_DIVERGED`), never a continuation, until the attempts are exhausted.
    (`restore: replay`, so that no chance agreement of `auto`'s 3-step check is involved.)"""
    spec = env_spec(tmp, "slippery", [("walker-a", f"{ENVS}:walk"),
                                      ("walker-b", f"{ENVS}:walk")],
                    {"impl": PARALLEL, "config": {"env": f"{ENVS}:GlobalRandomLineEnv",
                                                  "restore": "replay", "seed": 3}}, 20)
    code, summary, err = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "process",
                                  "--fault", f"kill:slippery@{KILL_AT}")
    assert code != 0 and summary["state"] == "failed", (summary, events(err, "recovery.resumed"))
    assert summary["failures"][0]["participant"] == "slippery"  # the kill happened
    assert summary["recoveries"] == 0
    assert summary["outcome"]["error"] == "recovery attempts exhausted", summary["outcome"]
    failure = summary["failures"][-1]
    assert failure["code"] == "RESTORE_DIVERGED" and failure["participant"] == "slippery"
    # the steps up to the checkpoint replayed, each the same by chance at most 1/4
    assert re.search(rf"world slippery \(env {ENVS}:GlobalRandomLineEnv\) did not replay its "
                     r"episode: step [1-9][0-9]*'s result differs from the recorded one",
                     failure["message"]), failure


def test_an_unpicklable_world_with_restore_snapshot_fails_at_once_naming_it(tmp: Path) -> None:
    spec = env_spec(tmp, "stuck", [("walker-a", f"{ENVS}:walk"), ("walker-b", f"{ENVS}:walk")],
                    {"impl": PARALLEL, "config": {"env": f"{ENVS}:UnpicklableLineEnv",
                                                  "restore": "snapshot"}}, 20)
    code, summary, _ = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "process")
    assert code != 0 and summary["state"] == "failed", summary
    assert summary["recoveries"] == 0 and len(summary["failures"]) == 1, summary
    (failure,) = summary["failures"]
    assert failure["code"] == "INVALID_ARGUMENT"
    assert f"world stuck (env {ENVS}:UnpicklableLineEnv) cannot be pickled" \
        in failure["message"]
    assert "set restore to auto or replay" in failure["message"]


def test_an_action_outside_its_space_ends_the_run_at_once_naming_agent_and_space(
        tmp: Path) -> None:
    spec = env_spec(tmp, "wild", [("walker-a", f"{ENVS}:wild"), ("walker-b", f"{ENVS}:walk")],
                    {"impl": PARALLEL, "config": {"env": f"{ENVS}:LineEnv", "seed": 3}}, 30)
    code, summary, _ = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "process")
    assert code != 0 and summary["state"] == "failed", summary
    assert summary["recoveries"] == 0 and len(summary["failures"]) == 1, summary
    (failure,) = summary["failures"]
    assert failure["participant"] == "walker-a"
    assert "policy tests.cli.adapter_envs:wild returned 7, outside its action space " \
           "Discrete(3, start=0)" in failure["message"]


# --------------------------------------------------------------------------------------------
# per-agent binary observations, well-known envs, friction (docs/adapters.md)

POLICY_MODEL = "workers.adapters.pettingzoo:PolicyModel"
PZ_WORLD = "workers.adapters.pettingzoo:ParallelEnvWorld"


def write_spec(tmp: Path, name: str, doc: dict[str, Any]) -> str:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def agents(prefix: str, count: int, policy: str) -> list[dict[str, Any]]:
    return [{"agentId": f"{prefix}-{i:02d}", "portId": f"p{i:02d}", "model": POLICY_MODEL,
             "modelConfig": {"policy": f"{ENVS}:{policy}"}} for i in range(count)]


def test_a_pettingzoo_env_with_pixel_observations_runs(tmp: Path) -> None:
    """PettingZoo's pistonball: each piston's observation is its own 457×120×3 picture (164 KB,
    far over the 32 KiB a typed value may hold, so it travels as a binary array by reference);
    the spec gives no task (the adapter world's EnvTask runs) and integer steps and seed."""
    doc = {"sessionId": "pistons", "steps": 12, "seed": 3,
           "agents": agents("piston", 4, "pistons"),
           "world": {"worldId": "pistonball", "impl": PZ_WORLD,
                     "config": {"env": "pettingzoo.butterfly.pistonball_v6:parallel_env",
                                "kwargs": {"n_pistons": 4}, "seed": 1}}}
    code, summary, err = flyd_run(tmp, "--spec", write_spec(tmp, "pistons", doc), *PLUGINS,
                                  "--mode", "process", timeout=150)
    assert code == 0 and summary["state"] == "succeeded", (summary, err[-2000:])
    assert summary["boundary"] == summary["steps"] == 12
    assert summary["counter"] == 12  # the env's own steps: the EnvTask's progress counter
    assert summary["recoveries"] == 0


def test_a_64_agent_pettingzoo_run_in_process_mode_succeeds(tmp: Path) -> None:
    """MPE2's simple_spread with 64 particles, one agent process each: every agent receives
    only its own observation, so the step's messages grow with the agents, not their square."""
    doc = {"sessionId": "spread", "steps": 3, "seed": 3, "mode": "process",
           "agents": agents("particle", 64, "spread"),
           "world": {"worldId": "spread", "impl": PZ_WORLD,
                     "config": {"env": "mpe2.simple_spread_v3:parallel_env",
                                "kwargs": {"N": 64, "max_cycles": 25}, "seed": 2}},
           "checkpoints": {"everySteps": 0}}
    config = tmp / "wide.toml"
    config.write_text("[session]\nmax_agents = 64\n[leases]\nttl_s = 12\n")
    code, summary, err = flyd_run(tmp, "--spec", write_spec(tmp, "spread", doc), *PLUGINS,
                                  "--config", str(config), timeout=170)
    assert code == 0 and summary["state"] == "succeeded", (summary, err[-2000:])
    assert summary["mode"] == "process" and summary["boundary"] == 3
    assert len(summary["workers"]) == 65 and summary["counter"] == 3


def test_a_non_finite_reward_ends_the_run_at_once_naming_the_env_and_the_task(
        tmp: Path) -> None:
    doc = {"sessionId": "nan", "steps": 20, "agents": agents("walker", 2, "walk"),
           "world": {"worldId": "line", "impl": PZ_WORLD,
                     "config": {"env": f"{ENVS}:BadRewardLineEnv", "kwargs": {"atStep": 4}}},
           "checkpoints": {"recoveryMaxAttempts": 3}}
    code, summary, _ = flyd_run(tmp, "--spec", write_spec(tmp, "nan", doc), *PLUGINS,
                                "--mode", "process")
    assert code != 0 and summary["state"] == "failed", summary
    outcome = summary["outcome"]
    assert outcome["error"] == "plugin failed"
    message = outcome["failure"]["message"]
    assert f"env {ENVS}:BadRewardLineEnv" in message and "reward is nan" in message
    assert "workers.adapters.pettingzoo:EnvTask" in message
    assert outcome["failure"]["participant"] == "line"
    # no retry: one epoch, no recovery, the failure at the step the env gave it
    assert summary["recoveries"] == 0 and summary["epochs"] == ["e1"]
    assert summary["boundary"] == 3

    doc["world"]["config"]["kwargs"] = {"atStep": 2, "reward": -5e13}
    code, summary, _ = flyd_run(tmp, "--spec", write_spec(tmp, "huge", doc), *PLUGINS,
                                "--mode", "thread")
    assert code != 0 and summary["recoveries"] == 0 and summary["boundary"] == 1, summary
    assert "reward is -5e+13" in summary["outcome"]["failure"]["message"], summary


def test_a_world_task_mismatch_is_refused_at_submit_naming_both(tmp: Path) -> None:
    doc = {"steps": 5, "agents": agents("walker", 2, "walk"),
           "world": {"worldId": "line", "impl": PZ_WORLD, "config": {"env": f"{ENVS}:LineEnv"}},
           "task": {"impl": "workers.synthetic:CounterTask"}}
    code, summary, err = flyd_run(tmp, "--spec", write_spec(tmp, "mismatch", doc), *PLUGINS)
    assert code == 2 and summary["error"]["code"] == "USAGE"
    message = summary["error"]["message"]
    assert "/task/impl" in message and "workers.synthetic:CounterTask" in message
    assert PZ_WORLD in message and message in err  # the same line on stderr
    reverse = {"steps": 5, "task": {"impl": "workers.adapters.pettingzoo:EnvTask"}}
    code, summary, _ = flyd_run(tmp, "--spec", write_spec(tmp, "reverse", reverse), *PLUGINS)
    assert code == 2 and "workers.synthetic:CounterArena" in summary["error"]["message"]


def test_episodes_reset_within_a_run_and_recover_across_a_reset(tmp: Path) -> None:
    """`episodes: 3` on a short line: the env resets twice within the run (each reset seeded
    from the world seed and the episode number) and terminal `done` ends the run with the third
    episode; a world killed after the first reset recovers with the clean digest."""
    doc = {"sessionId": "episodes", "steps": 200, "seed": 5,
           "agents": agents("walker", 2, "walk"),
           "world": {"worldId": "line", "impl": PZ_WORLD,
                     "config": {"env": f"{ENVS}:TimedLineEnv",
                                "kwargs": {"size": 8, "maxSteps": 7}, "seed": 4,
                                "episodes": 3}},
           "task": {"terminal": "done"}, "checkpoints": {"everySteps": 4}}
    spec = write_spec(tmp, "episodes", doc)
    code, summary, err = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "thread")
    assert code == 0 and summary["state"] == "succeeded", (summary, err[-2000:])
    # three episodes of at most 7 steps each, and more than one episode's worth
    assert 7 < summary["boundary"] <= 21 and summary["counter"] == summary["boundary"]
    code, killed, _ = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "process",
                               "--fault", f"kill:line@{summary['boundary'] - 3}")
    assert code == 0 and killed["recoveries"] == 1, killed
    assert killed["boundary"] == summary["boundary"]
    assert killed["behaviourDigest"] == summary["behaviourDigest"]


def test_an_inline_policy_model_behaves_as_the_policy_model(tmp: Path) -> None:
    """`InlinePolicyModel` only moves the calls onto the worker's event loop: the same spec
    gives the same behaviour digest."""
    digests = []
    for model in ("PolicyModel", "InlinePolicyModel"):
        doc = {"sessionId": "inline", "steps": 25, "seed": 5,
               "agents": [{**a, "model": f"workers.adapters.pettingzoo:{model}"}
                          for a in agents("walker", 2, "walk")],
               "world": {"worldId": "line", "impl": PZ_WORLD,
                         "config": {"env": f"{ENVS}:LineEnv", "seed": 2}}}
        code, summary, _ = flyd_run(tmp, "--spec", write_spec(tmp, model, doc), *PLUGINS,
                                    "--mode", "process")
        assert code == 0 and summary["state"] == "succeeded", summary
        digests.append(summary["behaviourDigest"])
    assert digests[0] == digests[1]


def test_a_recorded_run_renders_only_the_frames_it_keeps_and_recovers_them_exactly(
        tmp: Path) -> None:
    """`--record-every 4` gives the adapter world `render_every: 4`: the env renders at
    boundaries 0, 4, 8, … only, and every other boundary serves the frame before it again. A
    world killed after a checkpoint at a boundary that is no multiple of 4 serves the frames of
    the undisturbed run (its trace's view digests, its export and its behaviour digest)."""
    renders = tmp / "renders.txt"
    doc = {"sessionId": "tally", "steps": 30, "seed": 5, "agents": agents("walker", 2, "walk"),
           "world": {"worldId": "line", "impl": PZ_WORLD,
                     "config": {"env": f"{ENVS}:TallyLineEnv", "render": True, "seed": 3,
                                "kwargs": {"size": 8, "renderLog": str(renders)}}},
           "checkpoints": {"everySteps": 5}}
    spec = write_spec(tmp, "tally", doc)
    record = ("--record", str(tmp / "run.gif"), "--record-every", "4")

    def run(*args: str) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]],
                                 str]:
        trace = tmp / "trace.jsonl"
        code, summary, err = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "process",
                                      *record, "--trace", str(trace), *args)
        assert code == 0 and summary["state"] == "succeeded", (summary, err[-2000:])
        assert summary["boundary"] == 30
        lines = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
        return summary, [line for line in lines if "resume" not in line], \
            export(tmp, summary["run"]), err

    clean, clean_trace, clean_export, _ = run()
    assert clean["recoveries"] == 0
    # the world's first render sizes its view when it is built; then boundaries 0, 4, …, 28
    assert [int(n) for n in renders.read_text().split()] == [0, *range(0, 30, 4)]
    frames = [r["observationBoundaries"] for r in clean_trace]
    assert len(frames) == 30 and all(len(f) == 1 for f in frames)
    # boundary b serves the frame drawn at b − b % 4 (the pictures do change along the run)
    assert frames[5 - 1][0]["digest"] == frames[4 - 1][0]["digest"]
    assert len({f[0]["digest"] for f in frames}) > 2

    summary, trace, lines, err = run("--fault", "kill:line@13")
    assert summary["recoveries"] == 1 and summary["epochs"] == ["e1", "e2"], summary
    (resumed,) = events(err, "recovery.resumed")
    assert int(str(resumed["boundary"])) in (5, 10), resumed  # restored between two renders
    assert trace == clean_trace
    assert lines == clean_export
    assert summary["behaviourDigest"] == clean["behaviourDigest"]

    doc["world"]["config"]["render_every"] = 3
    code, refused, _ = flyd_run(tmp, "--spec", write_spec(tmp, "tally", doc), *PLUGINS,
                                *record)
    assert code == 2 and refused["error"]["code"] == "USAGE"
    assert "the world config's render_every 3 does not divide it" in refused["error"]["message"]
