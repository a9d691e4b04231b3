"""Unit tests of the lease core's table and of `LeaseParams` from the configuration (§4.2, §5.2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flyd.config import load_config
from flyd.errors import ConfigError
from flyd.leases.core import (
    BEGIN,
    END,
    CancelScope,
    Forget,
    GrantRow,
    LeaseCore,
    LeaseCoreError,
    LeaseLost,
    Relinquish,
    RenewRow,
    StartScope,
    StopForCancel,
)
from flyd.leases.core import LeasePhase as Phase
from flyd.leases.params import LeaseParams, LeaseParamsError

P = LeaseParams.short_ttl()


def _active(core: LeaseCore, run: str = "r", epoch: int = 1, t: float = 0.0) -> None:
    core.on_granted([GrantRow(run, epoch, 1)], t)
    core.end(run, "start")


def test_lease_params_from_the_configuration(tmp_path: Path) -> None:
    """`[leases]` and the `[database]` keys of §4.3 become `LeaseParams` in the configuration,
    which names the file of a bad key; a violated clause is a `LeaseParamsError`."""
    toml = tmp_path / "f.toml"

    def params(text: str) -> LeaseParams:
        toml.write_text(text)
        return load_config(toml, env={}).settings.leases

    p = params("[leases]\nttl_s = 30\nclaim_batch = 2\n"
               "[database]\nstatement_timeout_ms = 1000\nkeepalives = 1\n")
    assert p.ttl_s == 30.0 and p.H == 6.0 and p.claim_batch == 2 and p.S == 1.0
    assert params("") == LeaseParams()
    for text, problem in (("ttl = 3", "unknown key"), ("claim_batch = 2.5", "must be an integer"),
                          ('ttl_s = "15"', "must be a number")):
        with pytest.raises(ConfigError, match=problem) as refused:
            params(f"[leases]\n{text}\n")
        assert str(toml) in str(refused.value)
    with pytest.raises(ConfigError) as violated:
        params("[leases]\nttl_s = 4\n")
    assert "§4.3.2" in str(violated.value)
    with pytest.raises(LeaseParamsError) as info:
        LeaseParams.of({"ttl_s": 4})
    assert info.value.clause == "§4.3.2" and isinstance(info.value, ConfigError)


def test_core_refuses_invalid_params() -> None:
    with pytest.raises(LeaseParamsError):
        LeaseCore(LeaseParams(ttl_s=4), "n")


def test_every_table_transition() -> None:
    for (phase, kind), nxt in BEGIN.items():
        core = LeaseCore(P, "n")
        _active(core)
        if phase is Phase.STARTING:
            core = LeaseCore(P, "n")
            core.on_granted([GrantRow("r", 1, 1)], 0.0)
        assert core.begin("r", kind).phase is nxt
    assert END[(Phase.FINISHING, "finish", "committed")] is Phase.DONE
    core = LeaseCore(P, "n")
    _active(core)
    with pytest.raises(LeaseCoreError) as info:
        core.begin("r", "start")
    assert info.value.code == "LEASE_CORE_PROTOCOL"
    with pytest.raises(LeaseCoreError):
        core.end("r", "commit")
    with pytest.raises(LeaseCoreError):
        core.begin("nope", "commit")
    core.begin("r", "commit")
    assert core.end("r", "commit", "failed") == []
    core.begin("r", "release")
    assert core.end("r", "release", "failed") == []
    assert core.hold("r", 1).phase is Phase.RELEASING  # type: ignore[union-attr]
    assert core.end("r", "release") == [Forget("r", 1)]
    assert core.holds == ()


def test_lost_outcome_cancel_relinquish_once() -> None:
    core = LeaseCore(P, "n", capacity=2)
    _active(core)
    core.begin("r", "commit")
    assert core.end("r", "commit", "lost") == [CancelScope("r", 1, "unknown_outcome_lost")]
    assert core.end("r", "commit") == []            # the scope unwinds after cancellation
    assert core.fence("r", 1, "fenced") == []       # one CancelScope per hold
    assert core.expire_due(1e9) == []
    assert core.scope_gone("r", 1) == [Relinquish("r", 1), Forget("r", 1)]
    assert core.scope_gone("r", 1) == []


def test_grant_epochs_and_cancel_flag() -> None:
    core = LeaseCore(P, "n", capacity=2)
    acts = core.on_granted([GrantRow("r", 2, 1, cancel_requested=True)], 0.0)
    assert acts == [StartScope("r", 2, 1), StopForCancel("r", 2)]
    core.end("r", "start")
    b = core.renew_batch(0.1)
    assert core.on_renewed(b, [RenewRow("r", 2, cancel_requested=True)], 0.1) == []
    with pytest.raises(LeaseCoreError):
        core.on_granted([GrantRow("r", 1, 1)], 0.2)
    acts = core.on_granted([GrantRow("r", 3, 2)], 0.3)
    assert acts == [CancelScope("r", 2, "fenced"), StartScope("r", 3, 2)]
    with pytest.raises(LeaseLost):
        core.check("r", 2, 0.3, 0.0)
    assert core.check("r", 3, 0.3, 0.0).phase is Phase.STARTING


def test_free_capacity_needs_recent_ack() -> None:
    core = LeaseCore(P, "n", capacity=3)
    assert core.free_capacity(0.0) == 0
    core.on_renewed(core.renew_batch(0.0), [], t_send=0.0)  # empty batch: registry heartbeat
    assert core.free_capacity(2 * P.H) == 3
    assert core.free_capacity(2 * P.H + 0.01) == 0
    core.on_granted([GrantRow("a", 1, 1)], 0.0)
    core.fence("a", 1, "drain_timeout")
    assert core.free_capacity(0.5) == 2             # a lost, unforgotten hold keeps capacity
    core.scope_gone("a", 1)
    assert core.free_capacity(0.5) == 3
