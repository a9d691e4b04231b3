"""`python -m tests.distribution.sim --seed <n> [--kind K] [--variant V] [--digest-only]`:
replay one seed with its full trace (or print only its digest); exit 1 if the oracle objects."""

from __future__ import annotations

import argparse
import sys

from .canaries import variant
from .sweep import replay
from .world import KINDS, digest, run_seed


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.distribution.sim")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--kind", default="mixed", choices=KINDS)
    ap.add_argument("--variant", default="real")
    ap.add_argument("--digest-only", action="store_true")
    args = ap.parse_args(argv)
    if args.digest_only:
        print(digest(run_seed(args.seed, args.kind, variant(args.variant))))
        return 0
    return 0 if replay(args.seed, args.kind, args.variant).ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
