"""pipeline.teacher without JAX: a teacher run's snapshots (NumPy tensors published with
the ParamServer) pinned and copied under the student run, the refusals, and the copy's
checks (on-policy distillation, `distill.teacher`)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import ConfigError, RunConfig
from pipeline.paramserver.adapters import base_digest
from pipeline.run import Run, base_server, weights_server
from pipeline.storage.urls import local_path
from pipeline.teacher import (
    COPY_CLAIM_KEY,
    PIN_KEY,
    TEACHER_PREFIX,
    TeacherError,
    check_copy,
    pin_teacher,
    read_pin,
    teacher_config,
    teacher_server,
)
from tests.runs import tiny_config


def _tensors(value: float) -> dict[str, np.ndarray]:
    """A snapshot whose every value says which one it is."""
    return {
        "embed": np.full((4, 3), value, np.float32),
        "layers.0.w": np.arange(6, dtype=np.float32).reshape(2, 3) + value,
    }


def make_teacher(url: str, versions=(1, 2), base: bool = True, *overrides: str) -> Run:
    """A teacher run with a base snapshot (value -1) and weight versions (value v)."""
    run = Run.create(url, tiny_config("model.hidden_size=48", *overrides))
    if base:
        server = base_server(run)
        server.publish(0, _tensors(-1.0), epoch=server.acquire_epoch())
    if versions:
        server = weights_server(run)
        epoch = server.acquire_epoch()
        for v in versions:
            server.publish(v, _tensors(float(v)), epoch=epoch)
    return run


def make_student(url: str, teacher: str, version: str = "latest", *overrides: str) -> Run:
    cfg = tiny_config(
        "trainer.algorithm=opd",
        f"distill.teacher={teacher}",
        f"distill.teacher_version={version}",
        *overrides,
    )
    return Run.create(url, cfg)


def copied(run: Run) -> dict[str, np.ndarray]:
    return dict(teacher_server(run).pull(0).tensors)


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture
def teacher(tmp_path: Path) -> Run:
    return make_teacher(str(tmp_path / "teacher"))


@pytest.mark.parametrize(
    ("requested", "version", "value"), [("latest", 2, 2.0), ("1", 1, 1.0), ("base", "base", -1.0)]
)
def test_pin_teacher_resolves_the_requested_version(teacher, tmp_path, requested, version, value):
    student = make_student(str(tmp_path / "student"), teacher.url, requested)
    pin = pin_teacher(student)
    assert (pin.run, pin.version) == (teacher.url, version)
    assert same(copied(student), _tensors(value))
    source = base_server(teacher) if version == "base" else weights_server(teacher)
    on_source = 0 if version == "base" else version
    assert pin.digest == base_digest(source.manifest(on_source))  # the snapshot's own digest
    record = json.loads(student.store.read(PIN_KEY))
    assert record == {
        "run": teacher.url,
        "version": version,
        "digest": pin.digest,
        "tokenizer": {"name": "char"},
        "requested": requested,
    }
    assert read_pin(student) == pin
    assert teacher_config(student).model == teacher.config.model  # the teacher's shape
    assert teacher_config(student).model.hidden_size == 48 != student.config.model.hidden_size
    where = "base" if version == "base" else f"v{version}"
    assert pin.describe() == f"{teacher.url} @ {where} ({pin.digest[:19]})"


def test_a_missing_version_is_refused_naming_the_published_ones(teacher, tmp_path):
    student = make_student(str(tmp_path / "student"), teacher.url, "7")
    with pytest.raises(TeacherError, match=r"has no version 7; published: 1, 2 \(or distill"):
        pin_teacher(student)
    assert not student.store.exists(PIN_KEY)


def test_a_teacher_with_nothing_published_is_refused(tmp_path):
    bare = make_teacher(str(tmp_path / "bare"), versions=(), base=False)
    latest = make_student(str(tmp_path / "a"), bare.url, "latest")
    with pytest.raises(TeacherError, match="has published no version yet; train it first or"):
        pin_teacher(latest)
    base = make_student(str(tmp_path / "b"), bare.url, "base")
    with pytest.raises(TeacherError, match=r"has no base snapshot yet \(run its SFT, or `rlax"):
        pin_teacher(base)
    for run in (latest, base):
        assert not run.store.exists(PIN_KEY)


def test_a_missing_teacher_run_is_refused(tmp_path):
    missing = str(tmp_path / "nowhere")
    student = make_student(str(tmp_path / "student"), missing)
    with pytest.raises(TeacherError, match=rf"distill.teacher='{missing}': no run at"):
        pin_teacher(student)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    byte = make_teacher(
        str(tmp_path / "byte"), (1,), True, "model.tokenizer=byte", "model.vocab_size=512"
    )
    student = make_student(str(tmp_path / "student"), byte.url)
    with pytest.raises(
        TeacherError,
        match=r"encodes text with model.tokenizer=byte, this run with model.tokenizer=char; "
        "a teacher must share the student's tokenizer",
    ):
        pin_teacher(student)
    assert not student.store.exists(PIN_KEY)


def test_a_run_without_a_teacher_pins_none(tmp_path):
    run = Run.create(str(tmp_path / "plain"), tiny_config())
    with pytest.raises(ConfigError, match="distill.teacher is empty"):
        pin_teacher(run)
    assert read_pin(run) is None


def test_the_pin_holds_when_the_teacher_publishes_more_and_a_second_call_copies_nothing(
    teacher, tmp_path
):
    """A retry or a resume after the teacher run moved on gets the pinned snapshot."""
    student = make_student(str(tmp_path / "student"), teacher.url)
    pin = pin_teacher(student)
    stored = {k: student.store.read(k) for k in student.store.list(TEACHER_PREFIX)}
    server = weights_server(teacher)
    server.publish(3, _tensors(3.0), epoch=server.acquire_epoch())
    again = pin_teacher(student)
    assert again == pin and again.version == 2
    assert {k: student.store.read(k) for k in student.store.list(TEACHER_PREFIX)} == stored
    assert teacher_server(student).versions() == [0]
    assert same(check_copy(student, again), _tensors(2.0))


def _shard(run: Run) -> Path:
    root = local_path(run.url) / TEACHER_PREFIX / "weights"
    (shard,) = [p for p in root.rglob("*.bin")]
    return shard


def test_check_copy_refuses_a_tampered_tensor_object_and_a_deleted_copy_is_copied_again(
    teacher, tmp_path
):
    student = make_student(str(tmp_path / "student"), teacher.url)
    pin = pin_teacher(student)
    assert same(check_copy(student, pin), _tensors(2.0))
    shard = _shard(student)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor value
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    with pytest.raises(TeacherError, match=r"teacher copy under .* is damaged \(.*crc32c"):
        check_copy(student, pin)
    # The repair the message names: delete the copy; the next job copies the pinned version
    # again, although the teacher run has published a newer one since.
    server = weights_server(teacher)
    server.publish(3, _tensors(3.0), epoch=server.acquire_epoch())
    shutil.rmtree(local_path(student.url) / TEACHER_PREFIX / "weights")
    with pytest.raises(TeacherError, match="is damaged .*not committed"):
        check_copy(student, pin)
    assert pin_teacher(student) == pin
    assert same(check_copy(student, pin), _tensors(2.0))


def test_check_copy_refuses_a_copy_of_another_snapshot(teacher, tmp_path):
    student = make_student(str(tmp_path / "student"), teacher.url)
    pin = pin_teacher(student)
    shutil.rmtree(local_path(student.url) / TEACHER_PREFIX / "weights")
    server = teacher_server(student)
    server.publish(0, _tensors(5.0), epoch=server.acquire_epoch())  # not the pinned v2
    with pytest.raises(
        TeacherError, match=rf"has digest sha256:\w+, but {teacher.url} @ v2 .* is pinned"
    ):
        check_copy(student, pin)


def test_the_student_config_needs_a_teacher_exactly_with_a_teacher_objective():
    with pytest.raises(ConfigError, match="distill.teacher='' is invalid; allowed: a teacher"):
        tiny_config("trainer.algorithm=opd")
    with pytest.raises(ConfigError, match="distill.teacher='/x' is invalid; allowed: empty"):
        tiny_config("distill.teacher=/x")
    mixed = tiny_config("trainer.distill_coef=0.5", "distill.teacher=/x")
    assert isinstance(mixed, RunConfig) and mixed.distill.enabled


def _claim(student: Run, owner: str, age_s: float) -> None:
    """A copy claim left by `owner` `age_s` seconds ago (a worker mid-copy, or one that died)."""
    claim = {"at": time.time() - age_s, "owner": owner}
    assert student.store.write_new(COPY_CLAIM_KEY, json.dumps(claim).encode())


def _weight_objects(student: Run) -> list[str]:
    return sorted(student.store.list(f"{TEACHER_PREFIX}/weights/"))


def test_a_fleet_copies_the_teacher_once_and_the_claimants_restart_resumes(teacher, tmp_path):
    """worker0 claimed the copy and died; worker1 waits for it instead of uploading a
    second copy, and worker0's restart resumes its claim at once: one copy's objects."""
    student = make_student(str(tmp_path / "student"), teacher.url)
    _claim(student, "worker0", age_s=0.0)
    pins = {}
    waiter = threading.Thread(target=lambda: pins.update(w1=pin_teacher(student, owner="worker1")))
    waiter.start()
    time.sleep(1.5)
    assert waiter.is_alive() and not teacher_server(student).versions()  # waiting, not copying
    t0 = time.monotonic()
    pins["w0"] = pin_teacher(student, owner="worker0")
    assert time.monotonic() - t0 < 5.0  # the claimant's restart does not wait on itself
    waiter.join(timeout=30)
    assert pins["w0"] == pins["w1"] == read_pin(student)
    straight = make_student(str(tmp_path / "straight"), teacher.url)
    pin_teacher(straight)
    # Object names carry epochs and attempt ids: count them, one copy's worth.
    assert len(_weight_objects(student)) == len(_weight_objects(straight))
    assert same(copied(student), copied(straight))


def test_a_claim_whose_job_never_comes_back_is_taken_over(teacher, tmp_path):
    """A claim older than wait_s (its worker gone for good) does not block the run."""
    student = make_student(str(tmp_path / "student"), teacher.url)
    _claim(student, "gone", age_s=1000.0)
    t0 = time.monotonic()
    pin = pin_teacher(student, owner="worker1", wait_s=600.0)
    assert time.monotonic() - t0 < 5.0 and pin.version == 2
    fresh = make_student(str(tmp_path / "fresh"), teacher.url)
    _claim(fresh, "busy", age_s=0.0)
    t0 = time.monotonic()
    assert pin_teacher(fresh, owner="worker1", wait_s=1.0) == read_pin(fresh)
    assert 1.0 <= time.monotonic() - t0 < 6.0  # waited its wait_s, then copied itself


def test_a_refused_teacher_leaves_no_claim(tmp_path):
    """The teacher is checked before a job claims the copy: fixing the config and retrying
    does not wait on a claim from the refused attempt."""
    teacher = make_teacher(str(tmp_path / "teacher"), versions=())
    student = make_student(str(tmp_path / "student"), teacher.url)
    with pytest.raises(TeacherError, match="has published no version yet"):
        pin_teacher(student, owner="worker0")
    assert not student.store.exists(COPY_CLAIM_KEY)
