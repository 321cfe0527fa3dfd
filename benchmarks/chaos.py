"""The full chaos run: >= 20 SIGKILLs of the trainer and rollout workers at random moments.

    python benchmarks/chaos.py [--kills 20] [--seed 0]

Runs `rlax chaos` on configs/chaos.yaml and writes the report to
benchmarks/results/chaos.md (+ .json). Exit code 1 if any invariant is broken.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline.ops.cli import main as rlax

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = ROOT / "runs" / f"bench-chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    out = ROOT / "benchmarks" / "results" / "chaos.md"
    return rlax(
        [
            "chaos",
            "--config",
            str(ROOT / "configs/chaos.yaml"),
            "--root",
            str(root),
            "--kills",
            str(args.kills),
            "--seed",
            str(args.seed),
            "--out",
            str(out),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
