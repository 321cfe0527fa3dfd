"""The `report` job: write a run's `report/report.md` and plots (`pipeline.report`).

`python -m pipeline.report_job --run URL [--keep-existing] [--summary]`; `rlax report`
and the DAGs' `report` task start it through `pipeline.ops.launcher` like every other job.
"""

from __future__ import annotations

import argparse

from pipeline.report import REPORT_KEY, build_report, headline
from pipeline.run import DONE_KEY, Run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.report_job",
        description="Write a run's report/report.md and plots.",
    )
    parser.add_argument("--run", required=True, help="run URL (directory or gs://...)")
    parser.add_argument(
        "--keep-existing",
        action="store_true",
        help="leave a finished run's report as it is (it was written after its evaluation)",
    )
    parser.add_argument(
        "--summary",
        action="store_true",
        help="print the headline table (pass@1, pass@k per version) instead of the report",
    )
    args = parser.parse_args(argv)
    run = Run.open(args.run)
    where = run.store.url_of(REPORT_KEY)
    if args.keep_existing and run.store.exists(DONE_KEY) and run.store.exists(REPORT_KEY):
        print(f"[report] already written: {where}")
    else:
        md = build_report(run)
        if not args.summary:
            print(md, flush=True)
        print(f"[report] {where}")
    if args.summary:
        evals = run.read_metrics("eval")
        print(f"[report] held-out evaluation (95% intervals):\n{headline(evals)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
