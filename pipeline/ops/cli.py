"""`rlax`: the command line of the pipeline.

    rlax demo   [--config FILE] [--run URL] [--workers N] [--airflow] [key=value ...]
    rlax init   --run URL [--config FILE] [key=value ...]   create a run and its data
    rlax sft    --run URL                                   SFT bootstrap (base model)
    rlax train  --run URL                                   the RL trainer
    rlax rollout --run URL [--worker-id ID]                 one rollout worker (join any time)
    rlax eval   --run URL [--version all|latest|N] [--k 1,4,8,16,32] [--follow]
                [--dataset humaneval]                   a built-in set, not the held-out one
    rlax orm    --run URL                                   ORM baseline (external verifier)
    rlax pass-rates --run URL --data GLOB --k 8 [--version V]  (for beam_jobs.curate)
    rlax report --run URL
    rlax tensorboard --run URL [--logdir DIR] [--follow]   metrics -> TensorBoard event files
    rlax import-hf PATH --run URL [--adapter DIR] [key=value ...]
                                                           HF checkpoint (+ tokenizer) -> base
    rlax airflow [--port N]                                 serve a local Airflow (UI)
    rlax chaos  [--config FILE] [--kills 20] [--out FILE]   kill -9 at random, compare
    rlax stack  up|status|down|restart NAME|preempt NAME  the production shape on 127.0.0.1
    rlax sandbox serve --host 127.0.0.1 --port N [--token-env NAME] [--concurrency N]
                       [--queue N] [--ro-path DIR ...]      the sandbox as an HTTP service
                       [--max-limit FIELD=N ...] [--max-body-kb N] [--max-connections N]
                       [--header-timeout S] [--body-timeout S] [--idle-timeout S]

Overrides are dotted config paths, e.g. `trainer.lr=3e-4 task.families=arithmetic` or
`mesh.trainer=[1,-1,1]` (device meshes, docs/scaling.md).
Job roles run as their own processes through `pipeline.ops.launcher`, the same command a
cluster would run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from pipeline.config import load_config
from pipeline.entrypoint import DEBUG_ENV, run_main
from pipeline.errors import ArgumentError
from pipeline.ops import PROJECT_ROOT, launcher

DEFAULT_CONFIG = PROJECT_ROOT / "configs" / "demo.yaml"
DEFAULT_CHAOS_CONFIG = DEFAULT_CONFIG.parent / "chaos.yaml"


def _config(args: argparse.Namespace):
    path = args.config
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    extra = {"workers": args.workers} if getattr(args, "workers", None) else None
    return load_config(path, args.overrides, extra=extra)


def cmd_demo(args: argparse.Namespace) -> int:
    from pipeline.ops.demo import run_demo
    from pipeline.run import Run

    cfg = _config(args)
    if getattr(args, "airflow", False):
        from pipeline.ops.airflow_local import demo_via_airflow

        return demo_via_airflow(
            cfg,
            config_path=args.config or DEFAULT_CONFIG,
            overrides=args.overrides,
            run=args.run,
            workers=args.workers,
            eval_every=args.eval_every or cfg.eval.every,
        )
    url = args.run or f"{cfg.storage.root.rstrip('/')}/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    run = Run.create(url, cfg)
    run_demo(run, workers=cfg.workers, eval_every=args.eval_every or cfg.eval.every)
    return 0


def cmd_airflow(args: argparse.Namespace) -> int:
    from pipeline.ops.airflow_local import DEFAULT_HOME, serve

    return serve(Path(args.home or DEFAULT_HOME), port=args.port, parallelism=args.parallelism)


def cmd_init(args: argparse.Namespace) -> int:
    from pipeline.problem_sets import init_run

    run, n_train, n_eval = init_run(args.run, _config(args))
    print(f"run {run.url}: {n_train} training and {n_eval} held-out problems")
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    import json

    from pipeline.ops.chaos import ChaosSettings, format_report, invariants_hold, run_chaos

    cfg = load_config(args.config or DEFAULT_CHAOS_CONFIG, args.overrides)
    root = args.root or f"{cfg.storage.root.rstrip('/')}/chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    settings = ChaosSettings(
        kills=args.kills,
        workers=args.workers,
        seed=args.seed,
        min_interval_s=args.min_interval,
        max_interval_s=args.max_interval,
        failpoints=args.failpoints,
        bit_identity=args.bit_identity,
    )
    result = run_chaos(root, cfg, settings)
    table = format_report(result)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(f"# Chaos run\n\n`rlax chaos` root: `{root}`\n\n{table}\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2))
    return 0 if invariants_hold(result) else 1


def cmd_import_hf(args: argparse.Namespace) -> int:
    """Publish a Hugging Face checkpoint as the base model (version 0 source) of a run."""
    cmd = launcher.hf_import_command(args.path, args.run, args.adapter)
    if args.config:
        cmd += ["--config", args.config]
    return launcher.run_supervised(cmd + list(args.overrides), launcher.job_env())


def cmd_sandbox_serve(args: argparse.Namespace) -> int:
    from pipeline.ops.http_guard import HttpLimits
    from pipeline.ops.sandbox_service import MAX_WORKER_KINDS, serve

    # Checked before anything starts: a bad value is one line (exit 2), not a traceback.
    http = HttpLimits(
        max_body_bytes=args.max_body_kb * 1024,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        idle_timeout_s=args.idle_timeout,
        max_connections=args.max_connections,
    )

    # The token is read from the environment, never the command line (which `ps` shows).
    token = os.environ.get(args.token_env) or None
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"rlax sandbox: warning: ${args.token_env} is unset, so anyone who can reach "
            f"{args.host}:{args.port} can run code here; set it to a shared secret",
            file=sys.stderr,
        )
    # Ctrl-C before the server took over its signals: serve's cleanup ran, nothing to say.
    with contextlib.suppress(KeyboardInterrupt):
        serve(
            args.host,
            args.port,
            token=token,
            concurrency=args.concurrency or None,
            queue=args.queue,
            ro_paths=tuple(args.ro_path),
            max_worker_kinds=args.max_worker_kinds or MAX_WORKER_KINDS,
            limit_maxima=dict(args.max_limit),
            http=http,
            log=lambda m: print(m, flush=True),
        )
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    from pipeline.ops.stack import main as stack_main

    return stack_main(args.stack_args)


def cmd_report(args: argparse.Namespace) -> int:
    return launcher.run_job("report", args.run)


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from pipeline.run import Run
    from pipeline.tb_export import export, local_logdir

    run = Run.open(args.run)
    logdir = args.logdir or local_logdir(run)
    if logdir is None:
        print(f"rlax: run {run.url} is not local: pass --logdir DIR", file=sys.stderr)
        return 2
    _writable_dir("--logdir", logdir)
    export(run, logdir, follow=args.follow, log=lambda m: print(m, flush=True))
    return 0


def cmd_track(args: argparse.Namespace) -> int:
    from pipeline.config import override_section
    from pipeline.run import Run
    from pipeline.tracking import export

    run = Run.open(args.run)
    cfg = override_section(run.config.tracking, "tracking", args.overrides)
    log = lambda m: print(m, flush=True)  # noqa: E731
    logged = export(run, cfg, follow=args.follow, log=log)
    summary = ", ".join(f"{name} {n}" for name, n in logged.items()) or "no backend"
    print(f"[tracking] records logged: {summary}", flush=True)
    return 0


def _writable_dir(flag: str, path: str | os.PathLike[str]) -> None:
    """Create directory `path` if needed; raise ArgumentError (one line) unless this user
    can write there, before a job starts and fails on it halfway."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".rlax-probe-{os.getpid()}"
        probe.touch()  # os.access says yes to root even on a read-only mount
        probe.unlink()
    except OSError as err:
        raise ArgumentError(
            f"{flag}={os.fspath(path)!r} is invalid ({err.strerror}); allowed: a directory "
            "this user can create and write"
        ) from None


def _job(role: str):
    def run(args: argparse.Namespace) -> int:
        from pipeline.run import Run

        Run.open(args.run)  # fail here, with a clear message, if the run does not exist
        return launcher.run_job(role, args.run, args.job_args)

    return run


def _port(text: str) -> int:
    """argparse type of a TCP port to listen on."""
    if not (text.isdigit() and 0 <= int(text) <= 65535):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a port; allowed: an integer 0-65535 (0: a free one)"
        )
    return int(text)


def _field_value(text: str) -> tuple[str, float]:
    """argparse type of FIELD=NUMBER (the field is checked by its user)."""
    field, _, value = text.partition("=")
    try:
        return field, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid; allowed: FIELD=NUMBER, such as processes=64"
        ) from None


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, but a command-line mistake is one line (exit 2) like every other bad input:
    the usage block argparse prints first (11 lines for `rlax sandbox serve`) buried the
    line that says what was wrong; `--help` still shows it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="rlax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks of expected errors (config, storage, YAML) instead of one line",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML run config (default: configs/demo.yaml)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4")

    p = sub.add_parser("demo", help="data -> SFT -> RL -> eval -> report, end to end")
    with_config(p)
    p.add_argument("--run", help="run URL (default: {storage.root}/demo-TIMESTAMP)")
    p.add_argument("--workers", type=int, help="number of rollout worker processes")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="evaluate versions 0, N, 2N, ... and the last (default: the config's eval.every)",
    )
    p.add_argument(
        "--airflow",
        action="store_true",
        help="run it as a run of the rlax_rl_training DAG on a local Airflow "
        "(standalone, LocalExecutor, SQLite, 127.0.0.1, AIRFLOW_HOME=./airflow_home)",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("airflow", help="serve a local Airflow (UI on 127.0.0.1) until Ctrl-C")
    p.add_argument("--home", help="AIRFLOW_HOME (default: ./airflow_home of the project)")
    p.add_argument("--port", type=int, default=8080, help="API/UI port (0: a free one)")
    p.add_argument("--parallelism", type=int, default=8, help="task slots (LocalExecutor)")
    p.set_defaults(func=cmd_airflow)

    p = sub.add_parser("init", help="create a run and generate its data")
    with_config(p)
    p.add_argument("--run", required=True)
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("chaos", help="SIGKILL processes at random; prove the run is unchanged")
    with_config(p)
    p.add_argument("--root", help="where the reference and chaos runs go")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-interval", type=float, default=1.0, help="seconds between kills, min")
    p.add_argument("--max-interval", type=float, default=5.0, help="seconds between kills, max")
    p.add_argument(
        "--failpoints",
        default="",
        help="RLAX_FAILPOINTS of each process until it hits one (teacher.before_pin, ...)",
    )
    p.add_argument(
        "--no-bit-identity",
        dest="bit_identity",
        action="store_false",
        help="report, but do not require, bit-identical final parameters and batches (an "
        "engine that is not bit-reproducible: sampler.engine=vllm); the other invariants "
        "still decide the exit code",
    )
    p.add_argument("--out", help="write the report table (markdown) and JSON here")
    p.set_defaults(func=cmd_chaos)

    p = sub.add_parser("sandbox", help="the sandbox as an HTTP service (docs/sandbox.md)")
    sandbox = p.add_subparsers(dest="sandbox_command", required=True)
    p = sandbox.add_parser("serve", help="serve POST /run_code and GET /health until Ctrl-C")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=_port, default=8080, help="port (0: a free one)")
    p.add_argument(
        "--token-env",
        default="RLAX_SANDBOX_TOKEN",
        help="environment variable holding the shared token (unset: no token required)",
    )
    p.add_argument("--concurrency", type=int, default=0, help="runs at once (0: one per CPU)")
    p.add_argument(
        "--queue",
        type=int,
        default=None,
        help="requests that may wait for a run slot; beyond, 429 (default: --concurrency)",
    )
    p.add_argument(
        "--ro-path",
        action="append",
        default=[],
        help="a host directory requests may bind read-only (rlax_limits.extra_ro_paths)",
    )
    p.add_argument(
        "--max-worker-kinds",
        type=int,
        default=None,
        help="distinct rlax_limits worker kinds (packages, warmup, mounts) kept at once "
        "(default 8)",
    )
    from pipeline.ops.http_guard import HttpLimits

    http = HttpLimits()
    p.add_argument(
        "--max-limit",
        type=_field_value,
        action="append",
        default=[],
        metavar="FIELD=N",
        help="the most a request may ask for of a Limits field (defaults: docs/sandbox.md)",
    )
    p.add_argument(
        "--max-body-kb",
        type=int,
        default=http.max_body_bytes // 1024,
        help="the largest request body, KiB; 413 beyond (default %(default)s)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=http.max_connections,
        help="connections open at once (default %(default)s)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=http.header_timeout_s,
        help="seconds a connection has to send a whole request head (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=http.body_timeout_s,
        help="seconds a request has to send its whole body; 408 past it (default %(default)s)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=http.idle_timeout_s,
        help="seconds an idle keep-alive connection is kept (default %(default)s)",
    )
    p.set_defaults(func=cmd_sandbox_serve)

    p = sub.add_parser(
        "stack",
        help="PostgreSQL, Redis, Airflow (Celery), GCS emulator, sandbox, Dask on 127.0.0.1",
        add_help=False,  # `rlax stack --help` is the stack's own
    )
    p.add_argument("stack_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_stack)

    p = sub.add_parser("import-hf", help="publish a Hugging Face checkpoint as a run's base")
    p.add_argument("path", help="directory with config.json + *.safetensors (+ tokenizer.json)")
    p.add_argument("--run", required=True)
    p.add_argument("--adapter", help="a PEFT LoRA adapter directory: a LoRA run's start")
    with_config(p)
    p.set_defaults(func=cmd_import_hf)

    p = sub.add_parser("report", help="write the markdown + PNG report of a run")
    p.add_argument("--run", required=True)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("tensorboard", help="export the run's metrics as TensorBoard event files")
    p.add_argument("--run", required=True)
    p.add_argument("--logdir", help="local directory (default: {run}/tensorboard for a local run)")
    p.add_argument(
        "--follow", action="store_true", help="keep exporting new records until the run is done"
    )
    p.set_defaults(func=cmd_tensorboard)

    p = sub.add_parser(
        "track",
        help="feed the run's metrics, config and report to its trackers (TensorBoard, MLflow, W&B)",
    )
    p.add_argument("--run", required=True)
    p.add_argument(
        "--follow", action="store_true", help="keep exporting new records until the run is done"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="tracking.* settings instead of the run's own, e.g. tracking.backends=[mlflow] "
        "tracking.mlflow_uri=http://127.0.0.1:5000",
    )
    p.set_defaults(func=cmd_track)

    for role, help_ in (
        ("sft", "SFT bootstrap of the base model"),
        ("train", "the RL trainer"),
        ("rollout", "a rollout worker"),
        ("pass-rates", "per-problem pass rates of a snapshot (for curation)"),
        ("eval", "evaluate published versions"),
        ("orm", "train the ORM baseline (external verifier) on the run's rollouts"),
    ):
        p = sub.add_parser(role, help=help_)
        p.add_argument("--run", required=True)
        p.set_defaults(func=_job(role))  # other options (--version ...) go to the job
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line parsed: `args.command`, its options, and `args.job_args`, the
    options a role command hands to its job. Exits 2 on an unknown argument."""
    parser = build_parser()
    # Role commands hand the options they do not know (--version, --data, ...) to the job.
    args, rest = parser.parse_known_args(argv)
    if args.command == "stack":  # its own parser takes all of it
        args.stack_args, rest = [*args.stack_args, *rest], []
    if args.command not in launcher.JOBS and hasattr(args, "overrides"):
        # argparse matches a command's positionals in one go, so after `rlax import-hf PATH
        # --run URL k=v` the overrides behind the option are left over: they are overrides.
        args.overrides = [*args.overrides, *(a for a in rest if not a.startswith("-"))]
        rest = [a for a in rest if a.startswith("-")]
    if rest and args.command not in launcher.JOBS:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.job_args = rest
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM and SIGHUP stop a command as Ctrl-C does: its cleanup runs (`rlax airflow`
    # stops all of Airflow). Role commands forward them to the job instead (run_supervised).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the jobs it starts inherit it
    # Expected errors (config, run, storage, YAML) end in one line, not a traceback.
    return run_main("rlax", lambda _argv: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
