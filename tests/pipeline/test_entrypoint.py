"""Expected errors end a command in one line naming what to check (the probe's finding 5:
transport failures and bad YAML printed 60-line tracebacks); `--debug` shows the traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.entrypoint import describe
from pipeline.storage import ObjectNotFound, StorageError

RLAX = str(Path(sys.executable).parent / "rlax")


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
