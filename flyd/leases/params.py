"""Lease timing parameters and their invariant (design/distribution.md §4.2, §4.3).

Rules:
- Every `[leases]` key of design/distribution.md §4.2 is a field with its default; the three
  `[database]` values the design/distribution.md §4.3 invariant reads (S, I, `connect_timeout`) are
  fields too, in the units of their keys.
- `heartbeat_interval_s = None` means H = T/5; `with_ttl(T)` (`--lease-ttl`) sets T only, so H
  follows T/5 unless it was set, and every other key keeps its value.
- `validate()` refuses a parameter set violating design/distribution.md §4.3 with one
  `LeaseParamsError` naming the clause (`§4.3.<n>`); `violations()` lists every violated clause, in
  clause order.
- The comparisons of design/distribution.md §4.3 are made on the decimal values as written
  (`Fraction(repr(x))`), so the boundary cases the spec quotes (1.75 ≥ 1.75, 2 + 1.5 ≤ 3.5, 0.75 ≥
  0.5 + 0.25) hold exactly and never flip on binary rounding.

Ambiguities resolved:
- Values that are not finite, or negative (zero where a period or bound must be positive,
  `connect_timeout_s` excepted: 0 = unset), are refused as clause `§4.2` (range) before
  design/distribution.md §4.3.
- `connect_timeout_s = 0` is "unset" and exempt from clause 6 (design/distribution.md §4.2 says so
  for tests).
- "G > 0" is part of clause 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from flyd.errors import ConfigError

DATABASE_KEYS: Final = ("statement_timeout_ms", "idle_in_transaction_timeout_ms",
                        "connect_timeout_s")
"""The `[database]` keys the design/distribution.md §4.3 invariant reads."""
INTEGRAL: Final = frozenset({"claim_batch", "max_attempts", "connect_timeout_s"})

CLAUSES: Final = {
    "§4.2": "every duration is finite and positive, counts at least 1",
    "§4.3.1": "0 ≤ ρ < 0.5 and G > 0",
    "§4.3.2": "R < H and 3·H ≤ G",
    "§4.3.3": "ε ≥ W + K + 1",
    "§4.3.4": "C ≥ S and B ≥ C + W",
    "§4.3.5": "S + I ≤ ε",
    "§4.3.6": "connect_timeout ≤ R when set; P ≤ T/5",
}


class LeaseParamsError(ConfigError):
    """A refused parameter set: `code` is the violated clause (e.g. ``§4.3.2``), exit 2."""

    def __init__(self, clause: str, message: str) -> None:
        self.code = clause
        self.clause = clause
        self.message = message
        self.mutation = "none"
        super().__init__(f"[leases] violates {clause} ({CLAUSES[clause]}): {message}")


def _q(x: float) -> Fraction:
    return Fraction(repr(float(x)))


@dataclass(frozen=True, slots=True)
class LeaseParams:
    """design/distribution.md §4.2 `[leases]` (plus the `[database]` values
    design/distribution.md §4.3 reads); seconds unless suffixed."""

    ttl_s: float = 15.0
    heartbeat_interval_s: float | None = None
    renew_timeout_s: float = 2.0
    clock_rate_bound: float = 0.1
    safety_margin_s: float = 3.5
    commit_timeout_s: float = 2.0
    commit_budget_s: float = 3.0
    watchdog_tick_s: float = 0.25
    kill_bound_s: float = 0.5
    claim_poll_s: float = 1.0
    claim_batch: int = 4
    reap_interval_s: float = 5.0
    drain_timeout_s: float = 20.0
    node_stale_after_s: float = 9.0
    max_attempts: int = 3
    statement_timeout_ms: float = 2000.0
    idle_in_transaction_timeout_ms: float = 1500.0
    connect_timeout_s: int = 2

    # -- symbols of design/distribution.md §4.2 ----------------------------------------------------
    @property
    def T(self) -> float:
        return self.ttl_s

    @property
    def H(self) -> float:
        if self.heartbeat_interval_s is None:
            return float(_q(self.ttl_s) / 5)
        return self.heartbeat_interval_s

    @property
    def R(self) -> float:
        return self.renew_timeout_s

    @property
    def G(self) -> float:
        """`give_up` = T·(1 − ρ) − ε (R3)."""
        return float(self._g())

    def _g(self) -> Fraction:
        return _q(self.ttl_s) * (1 - _q(self.clock_rate_bound)) - _q(self.safety_margin_s)

    @property
    def S(self) -> float:
        return self.statement_timeout_ms / 1000

    @property
    def I(self) -> float:  # noqa: E743
        return self.idle_in_transaction_timeout_ms / 1000

    # -- configuration -----------------------------------------------------------------------
    @classmethod
    def of(cls, values: Mapping[str, float | int | None]) -> LeaseParams:
        """From values whose names and types are already checked (the configuration checks
        `[leases]` and `[database]` against its own key table and hands them down typed):
        durations as floats, counts as ints. Validated."""
        return cls(**{k: v if k in INTEGRAL or v is None else float(v)  # type: ignore[arg-type]
                      for k, v in values.items()}).validate()

    # -- profiles --------------------------------------------------------------------------
    def with_ttl(self, ttl_s: float) -> LeaseParams:
        """`--lease-ttl`: T only; H follows T/5 unless `heartbeat_interval_s` was set."""
        return dataclasses.replace(self, ttl_s=ttl_s)

    @classmethod
    def short_ttl(cls) -> LeaseParams:
        """design/distribution.md §4.2 short-TTL profile (tests): T = 4; W, K and ρ at their
        defaults."""
        return cls(
            ttl_s=4.0, heartbeat_interval_s=0.6, renew_timeout_s=0.5, safety_margin_s=1.75,
            statement_timeout_ms=500.0, idle_in_transaction_timeout_ms=500.0,
            commit_timeout_s=0.5, commit_budget_s=0.75, claim_poll_s=0.5, connect_timeout_s=0,
        )

    # -- invariant -------------------------------------------------------------------------
    def _range_problems(self) -> list[str]:
        out: list[str] = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                out.append(f"{f.name} = {v!r} is not a finite number")
            elif f.name in ("claim_batch", "max_attempts"):
                if not isinstance(v, int) or v < 1:
                    out.append(f"{f.name} = {v!r} must be an integer ≥ 1")
            elif f.name == "connect_timeout_s":
                if not isinstance(v, int) or v < 0 or 0 < v < 2:
                    out.append(f"{f.name} = {v!r} must be 0 (unset) or an integer ≥ 2")
            elif f.name == "clock_rate_bound":
                pass  # clause 1
            elif v <= 0:
                out.append(f"{f.name} = {v!r} must be > 0")
        return out

    def violations(self) -> tuple[LeaseParamsError, ...]:
        """Every violated clause, in order; empty when the set is valid."""
        rng = self._range_problems()
        if rng:
            return (LeaseParamsError("§4.2", "; ".join(rng)),)
        t, h, r = _q(self.T), _q(self.H), _q(self.R)
        rho, eps, g = _q(self.clock_rate_bound), _q(self.safety_margin_s), self._g()
        w, k = _q(self.watchdog_tick_s), _q(self.kill_bound_s)
        c, b = _q(self.commit_timeout_s), _q(self.commit_budget_s)
        s = _q(self.statement_timeout_ms) / 1000
        i = _q(self.idle_in_transaction_timeout_ms) / 1000
        p, ct = _q(self.claim_poll_s), self.connect_timeout_s
        checks: list[tuple[str, bool, str]] = [
            ("§4.3.1", 0 <= rho < Fraction(1, 2), f"ρ = {self.clock_rate_bound}"),
            ("§4.3.1", g > 0, f"G = {float(g)}"),
            ("§4.3.2", r < h, f"R = {self.R} ≥ H = {self.H}"),
            ("§4.3.2", 3 * h <= g, f"3·H = {float(3 * h)} > G = {float(g)}"),
            ("§4.3.3", eps >= w + k + 1, f"ε = {self.safety_margin_s} < W + K + 1"),
            ("§4.3.4", c >= s, f"C = {self.commit_timeout_s} < S = {float(s)}"),
            ("§4.3.4", b >= c + w, f"B = {self.commit_budget_s} < C + W = {float(c + w)}"),
            ("§4.3.5", s + i <= eps, f"S + I = {float(s + i)} > ε = {self.safety_margin_s}"),
            ("§4.3.6", ct == 0 or ct <= r, f"connect_timeout = {ct} > R = {self.R}"),
            ("§4.3.6", p <= t / 5, f"P = {self.claim_poll_s} > T/5 = {float(t / 5)}"),
        ]
        found: dict[str, list[str]] = {}
        for clause, ok, why in checks:
            if not ok:
                found.setdefault(clause, []).append(why)
        return tuple(LeaseParamsError(cl, "; ".join(why)) for cl, why in found.items())

    def validate(self) -> LeaseParams:
        """Raise the first violated clause (its message lists all); return self when valid."""
        bad = self.violations()
        if bad:
            first = bad[0]
            rest = "".join(f"; also {e.clause}: {e.message}" for e in bad[1:])
            raise LeaseParamsError(first.clause, first.message + rest)
        return self
