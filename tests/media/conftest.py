"""The media tests reuse the session harness (`tests/session/harness.py`, `worker_rig.py`) by
their package path `tests.session.*`, as the session tests do; test directories have no
`__init__.py`, so the repository root must be importable however pytest was started."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
