"""Configuration keys take effect where cli.md §2.3 says (docs/configuration.md, "Where each
key takes effect").

Each test sets a key in a config file and observes what it changes in a real `flyd run` (real
router, real PostgreSQL) or in the run spec `flyctl runs submit` stores; with the key ignored the
observation differs (a run that fails at another call, or succeeds; a spec with the built-in
default). Deadlines of 1 ns expire before any reply can arrive, and a resolution budget of 1 ns
runs out before its first attempt, so the failures they provoke are deterministic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.cli.test_flyctl_runs import Site, flyctl, submit
from tests.cli.test_flyctl_runs import site as site
from tests.cli.test_run import _DSN, flyd_run
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(120)

#: a failed epoch is retried once, quickly: the tests look at the first failure
QUICK_RECOVERY = "[checkpoints]\nrecovery_max_attempts = 1\nrecovery_backoff_s = 0.05\n"


def _config(tmp: Path, text: str) -> Path:
    path = tmp / "flyd.toml"
    path.write_text(text)
    return path


def _run(tmp: Path, config: str, *args: str) -> tuple[int, dict[str, Any]]:
    code, summary, _ = flyd_run(tmp, "--config", str(_config(tmp, config)), *args)
    return code, summary


def _failure(summary: dict[str, Any]) -> dict[str, Any]:
    assert summary["failures"], summary
    first: dict[str, Any] = summary["failures"][0]
    return first


def _stored_spec(dsn: str, run_id: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT spec FROM flyd.runs WHERE run_id = %s", (run_id,)).fetchone()
    assert row is not None
    spec: dict[str, Any] = row[0]
    return spec


# -- [session] deadlines reach the coordinator (session.md §6.1) ------------------------------


def test_session_probe_s_is_the_deadline_of_a_step_call(tmp: Path) -> None:
    code, summary = _run(tmp, "[session]\nprobe_s = 1e-9\nresolve_s = 1e-9\n" + QUICK_RECOVERY,
                         "--steps", "5", "--mode", "inprocess")
    failure = _failure(summary)
    assert code == 1 and summary["state"] == "failed"
    assert "never resolved" in failure["message"]
    assert not any(m in failure["message"] for m in ("Worker.Hello", "Initialize", "State."))


def test_session_resolve_s_is_the_resolution_budget(tmp: Path) -> None:
    code, summary = _run(tmp, "[session]\nprobe_s = 0.2\nresolve_s = 1e-9\n" + QUICK_RECOVERY,
                         "--steps", "6", "--mode", "inprocess",
                         "--fault", "fly-b.prepare_delay_ms=800@3")
    failure = _failure(summary)
    assert failure["participant"] == "fly-b"
    assert "Agent.Prepare: fly-b never resolved; its resolution budget of 1ns" in \
        failure["message"]
    assert code == 0 and summary["recoveries"] == 1, "the one-shot delay is gone after it"


def test_session_resolve_attempts_is_the_resolution_attempt_guard(tmp: Path) -> None:
    code, summary = _run(tmp, "[session]\nprobe_s = 0.2\nresolve_attempts = 1\n" + QUICK_RECOVERY,
                         "--steps", "6", "--mode", "inprocess",
                         "--fault", "fly-b.prepare_delay_ms=1200@3")
    failure = _failure(summary)
    assert failure["participant"] == "fly-b"
    assert "Agent.Prepare: fly-b never resolved; its resolution attempt guard of 1 attempts" \
        in failure["message"]
    assert code == 0 and summary["recoveries"] == 1


def test_session_boot_s_is_the_deadline_of_hello_and_initialize(tmp: Path) -> None:
    code, summary = _run(tmp, "[session]\nboot_s = 1e-9\nresolve_s = 1e-9\n" + QUICK_RECOVERY,
                         "--steps", "5", "--mode", "inprocess")
    failure = _failure(summary)
    assert code == 1 and summary["state"] == "failed"
    assert failure["message"].startswith(("Worker.Hello:", "Environment.Initialize:",
                                          "Agent.Initialize:")), failure
    assert "never resolved" in failure["message"]


def test_session_capture_s_is_the_deadline_of_state_calls(tmp: Path) -> None:
    code, summary = _run(tmp, "[session]\ncapture_s = 1e-9\nresolve_s = 1e-9\n" + QUICK_RECOVERY,
                         "--steps", "6", "--checkpoint-every", "2", "--mode", "inprocess")
    failure = _failure(summary)
    assert code == 1 and summary["state"] == "failed"
    assert failure["message"].startswith("State."), failure
    assert "never resolved" in failure["message"]


# -- [session] mode, dispatch, pacing: the defaults of the run specs this host builds ---------


def test_session_mode_is_the_default_of_flyd_run(tmp: Path) -> None:
    config = '[session]\nmode = "thread"\n'
    code, summary = _run(tmp, config, "--steps", "3")
    assert code == 0 and summary["mode"] == "thread"
    assert len({w["pid"] for w in summary["workers"]}) == 1, "threads of the node's process"
    code, summary = _run(tmp, config, "--steps", "3", "--mode", "process")
    assert code == 0 and summary["mode"] == "process", "the flag wins"
    assert len({w["pid"] for w in summary["workers"]}) == 3


def test_session_dispatch_is_the_default_of_flyd_run(tmp: Path) -> None:
    config = '[session]\ndispatch = "reversed"\n'
    code, summary = _run(tmp, config, "--steps", "3", "--mode", "inprocess")
    assert code == 0 and _stored_spec(_DSN[tmp], summary["run"])["dispatch"] == "reversed"
    code, summary = _run(tmp, config, "--steps", "3", "--mode", "inprocess",
                         "--dispatch", "sequential")
    assert code == 0 and _stored_spec(_DSN[tmp], summary["run"])["dispatch"] == "sequential"


def test_session_pacing_is_the_default_of_flyd_run(tmp: Path) -> None:
    config = '[session]\npacing = "realtime"\n'
    code, summary = _run(tmp, config, "--steps", "30", "--mode", "inprocess")
    assert code == 0 and _stored_spec(_DSN[tmp], summary["run"])["pacing"] == "realtime"
    # paced at world time: 30 transitions take at least 29/60 s
    assert 0 < summary["stepsPerSecond"] <= round(30 * 60 / 29, 1) + 0.1
    code, summary = _run(tmp, config, "--steps", "3", "--mode", "inprocess", "--no-pace")
    assert code == 0 and _stored_spec(_DSN[tmp], summary["run"])["pacing"] == "off"


def test_session_and_cadence_keys_are_the_defaults_of_flyctl_runs_submit(site: Site) -> None:
    config = site.path / "flyd.toml"
    config.write_text('[session]\nmode = "in-process"\ndispatch = "sequential"\n'
                      'pacing = "realtime"\n[checkpoints]\nevery_steps = 7\n'
                      'every_seconds = 2.5\n')
    run = submit(site, "--steps", "5", "--config", str(config))
    spec = _stored_spec(site.dsn, run)
    assert (spec["mode"], spec["dispatch"], spec["pacing"]) == ("in-process", "sequential",
                                                                "realtime")
    assert (spec["checkpoints"]["everySteps"], spec["checkpoints"]["everySeconds"]) == (7, 2.5)
    run = submit(site, "--steps", "5", "--config", str(config), "--mode", "thread",
                 "--dispatch", "reversed", "--no-pace", "--checkpoint-every", "3")
    spec = _stored_spec(site.dsn, run)
    assert (spec["mode"], spec["dispatch"], spec["pacing"]) == ("thread", "reversed", "off")
    assert spec["checkpoints"]["everySteps"] == 3, "flags win"


# -- [leases] node_stale_after_s: flyctl status marks a silent node (distribution.md §4.2) ----


def test_leases_node_stale_after_s_marks_a_silent_node_in_status(site: Site) -> None:
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO flyd.nodes (node_id, node_name, host, pid, version, capacity, "
                     "heartbeat_at) VALUES ('n1-000000000000', 'n1', 'h', 1, '0', 1, "
                     "flyd.app_now() - interval '60 seconds')")
    states = {}
    for stale_s in (30, 90):
        config = site.path / "flyd.toml"
        config.write_text(f"[leases]\nnode_stale_after_s = {stale_s}\n")
        ran = flyctl(site, "status", "--config", str(config))
        assert ran.code == 0 and ran.json["source"] == "database", ran
        [node] = ran.json["nodes"]
        states[stale_s] = node["state"]
    assert states == {30: "silent", 90: "active"}
