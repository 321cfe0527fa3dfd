"""`rlax`: the command line of the pipeline.

    rlax demo   [--config FILE] [--run URL] [--workers N] [key=value ...]
    rlax init   --run URL [--config FILE] [key=value ...]   create a run and its data
    rlax sft    --run URL                                   SFT bootstrap (base model)
    rlax train  --run URL                                   the RL trainer
    rlax rollout --run URL [--worker-id ID]                 one rollout worker (join any time)
    rlax eval   --run URL [--version all|latest|N] [--follow]
    rlax report --run URL

Overrides are dotted config paths, e.g. `trainer.lr=3e-4 task.families=arithmetic`.
Job roles run as their own processes through `pipeline.launcher`, the same command a
cluster would run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipeline import launcher
from pipeline.config import ConfigError, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _config(args: argparse.Namespace):
    path = args.config
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    extra = {"workers": args.workers} if getattr(args, "workers", None) else None
    return load_config(path, args.overrides, extra=extra)


def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.demo import run_demo
    from pipeline.run import Run

    cfg = _config(args)
    url = args.run or f"{cfg.storage.root.rstrip('/')}/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    run = Run.create(url, cfg)
    run_demo(run, workers=cfg.workers, eval_every=args.eval_every)
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    from pipeline.demo import write_data
    from pipeline.run import Run

    run = Run.create(args.run, _config(args))
    n_train, n_eval = write_data(run)
    print(f"run {run.url}: {n_train} training and {n_eval} held-out problems")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pipeline.report import build_report
    from pipeline.run import Run

    print(build_report(Run.open(args.run)))
    return 0


def _job(role: str):
    def run(args: argparse.Namespace) -> int:
        from pipeline.run import Run

        Run.open(args.run)  # fail here, with a clear message, if the run does not exist
        return launcher.run_job(role, args.run, args.job_args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML run config (default: configs/demo.yaml)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4")

    p = sub.add_parser("demo", help="data -> SFT -> RL -> eval -> report, end to end")
    with_config(p)
    p.add_argument("--run", help="run URL (default: {storage.root}/demo-TIMESTAMP)")
    p.add_argument("--workers", type=int, help="number of rollout worker processes")
    p.add_argument("--eval-every", type=int, default=5, help="evaluate every Nth version")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("init", help="create a run and generate its data")
    with_config(p)
    p.add_argument("--run", required=True)
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("report", help="write the markdown + PNG report of a run")
    p.add_argument("--run", required=True)
    p.set_defaults(func=cmd_report)

    for role, help_ in (
        ("sft", "SFT bootstrap of the base model"),
        ("train", "the RL trainer"),
        ("rollout", "a rollout worker"),
        ("eval", "evaluate published versions"),
    ):
        p = sub.add_parser(role, help=help_)
        p.add_argument("--run", required=True)
        p.add_argument(
            "job_args",
            nargs=argparse.REMAINDER,
            help="passed to the job (e.g. --worker-id, --version all --follow)",
        )
        p.set_defaults(func=_job(role))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"rlax: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - top level: one clear line, not a traceback
        from pipeline.run import RunError

        if isinstance(err, RunError):
            print(f"rlax: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
