"""The media tests reuse the session harness (`tests/session/harness.py`, `worker_rig.py`) by
their package path `tests.session.*`, as the session tests do; test directories have no
`__init__.py`, so the repository root must be importable however pytest was started. The state
tests' `claimed_run` fixture (a run claimed on PostgreSQL) serves the checkpoint test of media by
reference."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.state.conftest import claimed_run  # noqa: E402  - the state tests' claimed run fixture

__all__ = ["claimed_run"]
