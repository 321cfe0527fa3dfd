"""The `data` job: write a run's train/held-out problem sets (`pipeline.problem_sets`).

`python -m pipeline.data_job --run URL [--curated]`; the DAGs start it through
`pipeline.ops.launcher` like every other job. Skipped when the data is already there.
"""

from __future__ import annotations

import argparse

from pipeline.config import ConfigError
from pipeline.entrypoint import BAD_INPUT
from pipeline.layout import CURATED_PREFIX
from pipeline.problem_sets import write_curated_data, write_data
from pipeline.run import Run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.problem_sets",
        description="Write a run's train/held-out problem sets (skipped if already there).",
    )
    parser.add_argument("--run", required=True, help="run URL (directory or gs://...)")
    parser.add_argument(
        "--curated",
        action="store_true",
        help=f"take them from the Beam curation output under <run>/{CURATED_PREFIX}/ "
        "instead of generating synthetic problems",
    )
    args = parser.parse_args(argv)
    run = Run.open(args.run)
    try:
        n_train, n_eval = write_curated_data(run) if args.curated else write_data(run)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", flush=True)
        return BAD_INPUT
    print(f"[data] {n_train} training and {n_eval} held-out problems", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
