"""Expected errors end a command in one line naming what to check (the probe's finding 5:
transport failures and bad YAML printed 60-line tracebacks); `--debug` shows the traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.entrypoint import describe
from pipeline.run import Run
from pipeline.storage import ObjectNotFound, StorageError

RLAX = str(Path(sys.executable).parent / "rlax")
ROOT = Path(__file__).resolve().parents[2]


def test_bad_yaml_is_one_line_naming_the_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  lr: [1\n  steps: 3\n")
    out = subprocess.run(
        [RLAX, "init", "--run", str(tmp_path / "r"), "--config", str(bad)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not valid YAML at line 3, column 8" in lines[0], out.stderr
    assert not (tmp_path / "r").exists()


def test_debug_shows_the_traceback(tmp_path):
    out = subprocess.run(
        [RLAX, "--debug", "init", "--run", str(tmp_path / "r"), "--config", "nope.yaml"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr
    assert "ConfigError: config file 'nope.yaml' does not exist" in out.stderr


def test_storage_errors_say_what_to_check(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    line = describe(StorageError("write_new gs://b/x failed after 8 attempts"))
    assert line.startswith("storage unreachable or refusing: StorageError: write_new gs://b/x")
    assert "STORAGE_EMULATOR_HOST=http://127.0.0.1:9" in line
    assert describe(ObjectNotFound("gs://b/x/config.json")).startswith("not found in the store")
    assert describe(ConnectionResetError("reset")).startswith("storage unreachable")
    assert describe(ZeroDivisionError()) is None  # a bug keeps its traceback


# Issue 35, item 6: command-line inputs that printed 18-47-line tracebacks, or were
# accepted and crashed later. Each is refused up front: one line naming the argument or
# field and what is allowed, exit code 2. `{new}` is a path nothing exists at, `{run}` a
# run created by the test, `{file}` a regular file.
REFUSED = {
    "gs prefix with '..'": (["init", "--run", "gs://b/../x"], "prefix segment '..'"),
    "s3 scheme": (["init", "--run", "s3://b/x"], "unsupported storage url scheme 's3'"),
    "empty run": (["init", "--run", ""], "storage url must be a non-empty str"),
    "relative file url": (["init", "--run", "file://relative/x"], "must be absolute"),
    "run '..'": (["init", "--run", ".."], "--run '..' names an existing directory"),
    "run '.'": (["init", "--run", "."], "--run '.' names an existing directory"),
    "sizes above the ceiling": (
        ["init", "--run", "{new}", "model.hidden_size=100000000"],
        "model.hidden_size=100000000 is invalid; allowed: 1..32768",
    ),
    "num_train above the ceiling": (
        ["init", "--run", "{new}", "task.num_train=1000000000"],
        "task.num_train=1000000000 is invalid; allowed: 1..1000000",
    ),
    "max_new_tokens over max_seq_len": (
        ["init", "--run", "{new}", "sampler.max_new_tokens=300"],
        "sampler.max_new_tokens=300 is invalid; allowed: < model.max_seq_len=256",
    ),
    "empty eval.ks": (["init", "--run", "{new}", "eval.ks=[]"], "eval.ks=() is invalid"),
    "workers": (["init", "--run", "{new}", "workers=100000"], "workers=100000 is invalid"),
    "logdir under a file": (
        ["tensorboard", "--run", "{run}", "--logdir", "{file}/x"],
        "--logdir='{file}/x' is invalid (Not a directory)",
    ),
    "chaos --kills -3": (["chaos", "--kills", "-3"], "--kills=-3 is invalid; allowed: >= 1"),
    "chaos --workers 0": (["chaos", "--workers", "0"], "--workers=0 is invalid; allowed: 1..1024"),
}


@pytest.fixture(scope="module")
def made_run(tmp_path_factory):
    from pipeline.ops.cli import main

    root = tmp_path_factory.mktemp("refused")
    url = str(root / "run")
    assert main(["init", "--run", url, "--config", str(ROOT / "configs/tiny.yaml")]) == 0
    Run.open(url).log_metrics("train", 0, {"step": 0, "loss": 1.0})  # something to export
    (root / "file").write_text("not a directory")
    return {"run": url, "file": str(root / "file"), "root": root}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_in_one_line_bad_arguments(case, made_run, tmp_path, capsys, monkeypatch):
    from pipeline.ops.cli import main

    # '.' and '..' name directories that exist: here both inside tmp_path.
    cwd = tmp_path / "parent" / "cwd"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    argv, words = REFUSED[case]
    names = {**made_run, "new": str(tmp_path / "new")}
    argv = [a.format(**names) for a in argv]
    if argv[0] in ("init", "chaos"):  # the commands that take a config
        argv += ["--config", str(ROOT / "configs/tiny.yaml")]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert words.format(**names) in err[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["cwd", "parent"]  # nothing written


def test_refused_in_one_line_train_without_a_base_model_before_the_trainer_starts(made_run):
    out = subprocess.run(
        [RLAX, "train", "--run", made_run["run"]], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no base model and no checkpoint" in lines[0], out.stderr
    assert out.stdout == ""  # refused before an epoch was taken
    assert not Path(made_run["run"], "weights").exists()


def test_refused_in_one_line_a_bad_run_url_from_the_command(tmp_path):
    out = subprocess.run(
        [RLAX, "init", "--run", "gs://b/../x"], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "rlax: bad storage URL: storage url 'gs://b/../x': prefix segment '..' is not "
        "allowed; allowed: gs://bucket/a/b with non-empty segments other than '.' and '..'"
    ]


def test_overrides_after_an_option_reach_the_command():
    """`rlax import-hf PATH --run URL k=v` (the README's form): argparse left the overrides
    behind --run unmatched and rlax refused them as unrecognized arguments."""
    from pipeline.ops.cli import parse_args

    args = parse_args(
        ["import-hf", "ckpt", "--run", "r", "trainer.lr=1e-5", "--config", "c.yaml", "seed=3"]
    )
    assert (args.path, args.run, args.config) == ("ckpt", "r", "c.yaml")
    assert args.overrides == ["trainer.lr=1e-5", "seed=3"] and args.job_args == []
    args = parse_args(["demo", "seed=1", "--run", "r", "workers=2"])
    assert args.overrides == ["seed=1", "workers=2"]
    args = parse_args(["rollout", "--run", "r", "--worker-id", "w"])  # a role: to its job
    assert args.job_args == ["--worker-id", "w"]


def test_an_unknown_option_is_still_refused(capsys):
    from pipeline.ops.cli import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["import-hf", "ckpt", "--run", "r", "seed=3", "--bogus"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
