"""Wide sessions end to end: `flyd run` with 64 process agents and with 256 thread agents, each
recovering a worker killed after a checkpoint (README "Resource bounds"; state.md §2.1's
`MAX_PAYLOADS`; docs/launcher.md's fork server).

64 process workers start through the node's fork server while its lease runs on a 12 s TTL
(the shortest the other lease defaults allow, distribution.md §4.3): the node must never log
`lease_lost`, which it did on two CPUs when it spawned each worker itself. A kill after the
first checkpoint is recovered from that checkpoint with the clean `behaviourDigest` (a thread
run of the same composition, which every mode agrees with). 256 agents, the most
`[session] max_agents` allows, step and checkpoint every 10 steps (516 envelope payloads each)
and recover a kill the same way. Step counts are the fewest that put a kill after a committed
checkpoint and a checkpoint after the recovery.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.cli.test_run import flyd_run
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(600)


def agents(n: int) -> str:
    return ",".join(f"a{i}" for i in range(1, n + 1))


def events(stderr: str, name: str) -> list[dict[str, object]]:
    out = []
    for line in stderr.splitlines():
        if f'"{name}"' in line and line.startswith("{"):
            record = orjson.loads(line)
            if record.get("event") == name:
                out.append(record)
    return out


def wide_config(tmp: Path, max_agents: int, extra: str = "") -> str:
    config = tmp / "wide.toml"
    config.write_text(f"[session]\nmax_agents = {max_agents}\n{extra}")
    return str(config)


def test_64_process_agents_start_from_the_fork_server_and_recover_a_kill(tmp: Path) -> None:
    config = wide_config(tmp, 64, "[leases]\nttl_s = 12\n")
    steps = ["--steps", "16", "--checkpoint-every", "5", "--config", config,
             "--agents", agents(64)]
    code, clean, _ = flyd_run(tmp, *steps, "--mode", "thread", timeout=240)
    assert code == 0 and clean["state"] == "succeeded", clean["failures"]

    code, summary, err = flyd_run(tmp, *steps, "--mode", "process", "--fault", "kill:a37@12",
                                  timeout=300)
    assert code == 0 and summary["state"] == "succeeded", summary["failures"]
    assert events(err, "lease_lost") == [], "the node lost its lease while launching"
    assert summary["recoveries"] == 1, "the kill happened and was recovered"
    assert [f["participant"] for f in summary["failures"]] == ["a37"]
    assert summary["epochs"] == ["e1", "e2"], "recovered from a checkpoint, not from 0"
    assert summary["behaviourDigest"] == clean["behaviourDigest"]
    workers = summary["workers"]
    assert len(workers) == 65 and len({w["pid"] for w in workers}) == 65
    launched = events(err, "launcher.launched")
    assert len(launched) >= 2 * 65 and {e["mode"] for e in launched} == {"process"}
    assert len(events(err, "forkserver.started")) == 1, "one fork server served every launch"


def test_256_thread_agents_checkpoint_every_10_steps_and_recover_a_kill(tmp: Path) -> None:
    config = wide_config(tmp, 256)
    code, summary, err = flyd_run(
        tmp, "--steps", "20", "--checkpoint-every", "10", "--mode", "thread", "--config",
        config, "--agents", agents(256), "--fault", "kill:a200@15", timeout=500)
    assert code == 0 and summary["state"] == "succeeded", summary["failures"]
    assert summary["boundary"] == 20
    assert summary["recoveries"] == 1
    assert [f["participant"] for f in summary["failures"]] == ["a200"]
    assert summary["epochs"] == ["e1", "e2"], "recovered from the checkpoint at 10"
    assert summary["checkpoints"] >= 2
    assert len(summary["workers"]) == 257
    assert events(err, "lease_lost") == []
