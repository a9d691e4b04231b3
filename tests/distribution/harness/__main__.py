"""`python -m tests.distribution.harness --scenario <id> --seed <n>` (distribution.md §7.3.7):
one scenario outside pytest; exit 0 passed, 1 failed, 124 budget expired, 2 unknown scenario."""

from tests.distribution.harness.runner import main

raise SystemExit(main())
