"""Preemption: resume equals a straight run, SIGKILL mid-checkpoint and mid-batch lose
nothing, and a small chaos run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from pipeline.ops.chaos import (
    ChaosSettings,
    account,
    batches_equal,
    final_params_equal,
    run_with_chaos,
    teachers_equal,
)
from pipeline.rollouts import batch_key, from_parquet_bytes
from pipeline.run import DONE_KEY
from tests.runs import assert_bit_identical, clone_run, final_tensors, start, wait_all

STEPS = 6


@pytest.fixture(scope="module")
def reference(tiny_base, tmp_path_factory):
    """An uninterrupted run: trainer + 2 workers as processes."""
    root = tmp_path_factory.mktemp("reference")
    cfg = replace(tiny_base.config, trainer=replace(tiny_base.config.trainer, steps=STEPS))
    run = clone_run(tiny_base, str(root / "run"), cfg)
    procs = {n: start(run, n, root / "logs") for n in ("trainer", "w0", "w1")}
    codes = wait_all(procs, 240)
    assert codes == {"trainer": 0, "w0": 0, "w1": 0}, (root / "logs").as_posix()
    rewards = [r["reward_mean"] for r in run.read_metrics("train")]
    assert 0.0 < np.mean(rewards) < 1.0, "the base must give a real gradient"
    return run


def _checkpoint_leaves(run):
    from tpu_jobs.learning.checkpoints import TrainerCheckpoints
    from tpu_jobs.trainer import Trainer

    t = Trainer(run, log=lambda m: None)
    tree, meta = TrainerCheckpoints(run).restore_latest(t._template)
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)], meta


def test_resume_equals_continuous(reference, tmp_path):
    """Train 3 steps in this process, stop (checkpoint), continue in a fresh process."""
    from tpu_jobs.trainer import Trainer

    run = clone_run(reference, str(tmp_path / "run"), prefixes=("data/", "base/", "rollouts/"))
    trainer = Trainer(run, log=lambda m: "step 3/" in m and trainer.request_stop())
    state = trainer.train()
    assert state.step == 3 and not run.store.exists(DONE_KEY)
    codes = wait_all({"trainer": start(run, "trainer", tmp_path / "logs")}, 120)
    assert codes == {"trainer": 0}
    log = (tmp_path / "logs" / "trainer.log").read_text()
    assert "resumed from checkpoint at step 3" in log
    assert_bit_identical(final_tensors(reference)[1], final_tensors(run)[1])
    # Optimizer state (Adam moments, counts) equal bitwise too.
    ref_leaves, ref_meta = _checkpoint_leaves(reference)
    leaves, meta = _checkpoint_leaves(run)
    assert ref_meta["step"] == meta["step"] == STEPS
    assert len(ref_leaves) == len(leaves)
    for a, b in zip(ref_leaves, leaves, strict=True):
        assert a.tobytes() == b.tobytes()


def test_sigkill_during_checkpoint_write(reference, tmp_path):
    """Killed while the step-4 checkpoint is being written: restart from step 2."""
    run = clone_run(reference, str(tmp_path / "run"), prefixes=("data/", "base/", "rollouts/"))
    logs = tmp_path / "logs"
    env = {"RLAX_FAILPOINTS": "trainer.checkpoint_started@4"}
    codes = wait_all({"trainer": start(run, "trainer", logs, env)}, 120)
    assert codes == {"trainer": -9}
    ckpt_dir = tmp_path / "run" / "checkpoints"
    entries = sorted(p.name for p in ckpt_dir.iterdir())
    assert "2" in entries and "4" not in entries, entries
    assert any(e.startswith("4.") and "tmp" in e for e in entries), entries  # torn write
    codes = wait_all({"trainer": start(run, "trainer", logs)}, 120)
    assert codes == {"trainer": 0}
    assert "resumed from checkpoint at step 2" in (logs / "trainer.log").read_text()
    assert_bit_identical(final_tensors(reference)[1], final_tensors(run)[1])


def test_worker_sigkill_mid_batch(reference, tmp_path):
    """A worker dies after generating batch 1 but before committing it."""
    cfg = reference.config
    cfg = replace(cfg, rollout=replace(cfg.rollout, lease_seconds=3.0))
    run = clone_run(reference, str(tmp_path / "run"), cfg)
    logs = tmp_path / "logs"
    trainer = start(run, "trainer", logs)
    victim = start(run, "w0", logs, {"RLAX_FAILPOINTS": "rollout.before_commit@1"})
    assert wait_all({"w0": victim}, 120) == {"w0": -9}
    assert not run.store.exists("rollouts/b00000001.parquet")  # nothing partial visible
    lease = json.loads(run.store.read("rollouts/b00000001.lease"))
    assert lease["worker_id"] == "w0" and not lease["released"]
    codes = wait_all({"trainer": trainer, "w1": start(run, "w1", logs)}, 180)
    assert codes == {"trainer": 0, "w1": 0}
    attempts = [json.loads(run.store.read(k)) for k in run.store.list("metrics/rollout/")]
    committed = sorted(a["batch_index"] for a in attempts if a["committed"])
    assert committed == list(range(STEPS))  # each batch produced exactly once
    assert [a["worker_id"] for a in attempts if a["batch_index"] == 1] == ["w1"]
    assert_bit_identical(final_tensors(reference)[1], final_tensors(run)[1])


def _small_chaos(reference, run, failpoints: str = "", bits: bool = True) -> dict:
    """Four kills on `run` (and `failpoints` armed in each process until it hits one); it must
    end bit-identical to `reference` (final parameters, every batch, the teacher's pin and
    copy; `bits` false: not required), every batch produced once and consumed, the recovery
    really tested. Returns the harness's account of the run."""
    settings = ChaosSettings(
        kills=4,
        min_interval_s=2.0,
        max_interval_s=5.0,
        seed=3,
        timeout_s=400,
        failpoints=failpoints,
        bit_identity=bits,
    )
    stats = run_with_chaos(run, settings, log=lambda m: None)
    result = account(run, stats)
    identical, why = final_params_equal(reference, run)
    assert identical or not bits, why
    identical, why = batches_equal(reference, run)
    assert identical or not bits, why
    identical, why = teachers_equal(reference, run)
    assert identical is not False, why
    assert result["batches_lost"] == 0 and result["batches_produced_twice"] == 0
    assert result["batches_consumed"] == STEPS
    assert not result["latest_moved_backwards"]
    assert result["kills_total"] >= 2
    # The probe's finding 7: runs whose kills all landed before the first checkpoint passed.
    assert result["conclusive"], result["inconclusive_because"]
    assert result["trainer_killed_after_checkpoint"] >= 1
    assert result["workers_killed_mid_batch"] >= 1 and result["checkpoints_restored"] >= 1
    return result


def test_small_chaos_run(reference, tmp_path):
    """With delta versions on (a full snapshot every 3rd version), against the reference's
    full snapshots: a trainer killed between publishes pulls its delta base back from the
    store, workers rebuild from the version they hold; the end is still bit-identical."""
    cfg = replace(reference.config, paramserver=replace(reference.config.paramserver, full_every=3))
    run = clone_run(reference, str(tmp_path / "run"), cfg)
    _small_chaos(reference, run)
    from pipeline.paramserver import ParamServer

    manifests = [ParamServer(run.store).manifest(v) for v in range(STEPS + 1)]
    assert sum("full" not in m for m in manifests) >= 2  # deltas were really published


@pytest.mark.slow
def test_chaos_run_with_lora_ends_with_bit_identical_adapters(tiny_base, tmp_path):
    """LoRA on (adapter versions, a full snapshot every 3rd): an uninterrupted run and a
    chaos run end with bit-identical adapter versions. ~3 CPU-minutes: `slow` lane
    (`pytest -m slow tests/tpu_jobs/test_preemption.py -k lora`)."""
    from pipeline.lora import LoraConfig, is_adapter

    cfg = tiny_base.config
    cfg = replace(
        cfg,
        lora=LoraConfig(rank=4, alpha=8.0),
        trainer=replace(cfg.trainer, steps=STEPS),
        paramserver=replace(cfg.paramserver, full_every=3),
    )
    reference = clone_run(tiny_base, str(tmp_path / "reference"), cfg)
    procs = {n: start(reference, n, tmp_path / "logs") for n in ("trainer", "w0", "w1")}
    assert wait_all(procs, 240) == {"trainer": 0, "w0": 0, "w1": 0}
    run = clone_run(tiny_base, str(tmp_path / "chaos"), cfg)
    _small_chaos(reference, run)
    version, tensors = final_tensors(run)
    assert version == STEPS and tensors and all(map(is_adapter, tensors))


@pytest.mark.slow
def test_chaos_run_with_inflight_batches_loses_nothing_and_keeps_every_token(tiny_base, tmp_path):
    """In-flight batches (2 per stream, 2 batches per version so that streams form): a
    chaos run loses no batch and makes none twice, and every batch has the tokens and
    rewards of the uninterrupted one-at-a-time reference, its log-probs within 1e-5 (their
    last bits depend on the rows beside them, so they are not required to be identical).
    ~3 CPU-minutes: `slow` lane (`pytest -m slow tests/tpu_jobs/test_preemption.py -k inflight`)."""
    cfg = tiny_base.config
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=STEPS, publish_every=2))
    reference = clone_run(tiny_base, str(tmp_path / "reference"), cfg)
    procs = {n: start(reference, n, tmp_path / "logs") for n in ("trainer", "w0", "w1")}
    assert wait_all(procs, 240) == {"trainer": 0, "w0": 0, "w1": 0}
    cfg = replace(cfg, rollout=replace(cfg.rollout, inflight_batches=2))
    run = clone_run(tiny_base, str(tmp_path / "chaos"), cfg)
    _small_chaos(reference, run, bits=False)
    for index in range(STEPS):
        got = from_parquet_bytes(run.store.read(batch_key(index)))
        want = from_parquet_bytes(reference.store.read(batch_key(index)))
        assert got.completion_ids == want.completion_ids, index
        np.testing.assert_array_equal(got.reward, want.reward)
        for a, b in zip(got.behaviour_logprobs, want.behaviour_logprobs, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    attempts = [json.loads(run.store.read(k)) for k in run.store.list("metrics/rollout/")]
    joined = [a["batch_index"] for a in attempts if a.get("stream_position", 0) >= 1]
    assert joined, "no batch joined a running stream: the test did not test in-flight"


@pytest.mark.slow
def test_chaos_run_with_a_moe_model_ends_bit_identical(tmp_path):
    """A mixture-of-experts model (tiny_moe, SFT'd here), routing replay on (the workers'
    batches carry their routing), delta versions (a full snapshot every 3rd): an
    uninterrupted run and a chaos run end with bit-identical versions. ~4 CPU-minutes:
    `slow` lane (`pytest -m slow tests/tpu_jobs/test_preemption.py -k moe`)."""
    from pipeline.rollouts import from_parquet_bytes
    from tests.runs import make_base, tiny_config

    cfg = tiny_config(
        "model.preset=tiny_moe",
        "trainer.routing_replay=true",
        f"trainer.steps={STEPS}",
        "paramserver.full_every=3",
    )
    base = make_base(str(tmp_path / "base"), cfg)
    reference = clone_run(base, str(tmp_path / "reference"))
    procs = {n: start(reference, n, tmp_path / "logs") for n in ("trainer", "w0", "w1")}
    assert wait_all(procs, 240) == {"trainer": 0, "w0": 0, "w1": 0}
    rewards = [r["reward_mean"] for r in reference.read_metrics("train")]
    assert 0.0 < np.mean(rewards) < 1.0, "the base must give a real gradient"
    batch = from_parquet_bytes(reference.store.read("rollouts/b00000000.parquet"))
    assert batch.routing is not None and len(batch.routing) == len(batch)
    run = clone_run(base, str(tmp_path / "chaos"))
    _small_chaos(reference, run)
    assert final_tensors(run)[0] == STEPS


def _distill_config(teacher, *overrides: str):
    """A student run's config: opd, learning from `teacher`'s base."""
    from tests.runs import tiny_config

    return tiny_config(
        "trainer.algorithm=opd",
        f"distill.teacher={teacher.url}",
        "distill.teacher_version=base",
        *overrides,
    )


# pin_teacher as a rollout worker's startup runs it, in a process of its own (failpoints
# SIGKILL the process), once the wall clock reaches argv[2]: processes started together
# then enter it within a millisecond or so, not a few import times apart.
_PIN = (
    "import sys, time; from pipeline.run import Run; from pipeline.teacher import pin_teacher; "
    "run = Run.open(sys.argv[1]); time.sleep(max(0.0, float(sys.argv[2]) - time.time())); "
    "pin_teacher(run)"
)


def _pin_processes(run, failpoints: str = "", n: int = 1) -> list[int]:
    """Exit codes of `n` processes pinning `run`'s teacher at once."""
    import os
    import subprocess
    import sys
    import time

    env = {**os.environ, "RLAX_FAILPOINTS": failpoints}
    at = str(time.time() + 5.0)  # after every process's imports, even on 2 busy cores
    procs = [subprocess.Popen([sys.executable, "-c", _PIN, run.url, at], env=env) for _ in range(n)]
    return [p.wait(timeout=120) for p in procs]


@pytest.mark.slow
def test_distill_teacher_pin_killed_before_publish_and_before_pin_is_finished_by_the_next_job(
    tiny_base, tmp_path
):
    """A job killed after the teacher's config is copied but not its weights, then one
    killed after the weights are committed but before the pin: the next job finishes the
    pin, with nothing copied twice, and pins what an uninterrupted pin does."""
    from pipeline.run import Run, base_server
    from pipeline.teacher import (
        PIN_KEY,
        TEACHER_CONFIG_KEY,
        check_copy,
        pin_teacher,
        read_pin,
        teacher_server,
    )

    cfg = _distill_config(tiny_base)
    run = Run.create(str(tmp_path / "killed"), cfg)
    server = teacher_server(run)
    assert _pin_processes(run, "teacher.before_publish") == [-9]
    assert run.store.exists(TEACHER_CONFIG_KEY) and server.versions() == []
    assert read_pin(run) is None
    assert _pin_processes(run, "teacher.before_pin") == [-9]
    assert server.versions() == [0] and read_pin(run) is None
    # Armed at both points, the next job finds the copy: it copies nothing, it only pins.
    assert _pin_processes(run, "teacher.before_publish,teacher.before_pin") == [0]
    assert server.current_epoch() == 1  # one copy begun (the first job died before its)
    straight = Run.create(str(tmp_path / "straight"), cfg)
    pin_teacher(straight)
    assert run.store.read(PIN_KEY) == straight.store.read(PIN_KEY)
    assert run.store.read(TEACHER_CONFIG_KEY) == tiny_base.store.read("config.json")
    check_copy(run, read_pin(run))
    base = base_server(tiny_base)
    expected = {k: np.asarray(t) for k, t in base.pull(base.latest_version()).tensors.items()}
    got = {k: np.asarray(t) for k, t in server.pull(0).tensors.items()}
    assert_bit_identical(expected, got)


@pytest.mark.slow
def test_distill_teacher_pinned_by_four_jobs_at_once_is_copied_once(tiny_base, tmp_path):
    """Four jobs entering pin_teacher together (a fleet of workers starting) all pin the
    same teacher from one committed copy: the losers of the copy's epoch race wait for the
    winner's. (Here all four began a copy in 2 of 3 runs: the teacher EPOCH at 4.)"""
    from pipeline.run import Run
    from pipeline.teacher import PIN_KEY, check_copy, pin_teacher, read_pin, teacher_server

    cfg = _distill_config(tiny_base)
    run = Run.create(str(tmp_path / "together"), cfg)
    assert _pin_processes(run, n=4) == [0] * 4
    assert teacher_server(run).versions() == [0]
    check_copy(run, read_pin(run))
    straight = Run.create(str(tmp_path / "straight"), cfg)
    pin_teacher(straight)
    assert run.store.read(PIN_KEY) == straight.store.read(PIN_KEY)


@pytest.mark.slow
def test_chaos_run_with_distillation_ends_bit_identical(tiny_base, tmp_path):
    """On-policy distillation (opd) of a smaller student (hidden 32, a 20-step SFT base)
    from tiny_base's base: an uninterrupted run and a chaos run (the first worker to copy the
    teacher killed before its pin, then the usual kills) end with bit-identical versions,
    batches (teacher_logprobs included) and teacher pins. `slow` lane
    (`pytest -m slow tests/tpu_jobs/test_preemption.py -k distill`)."""
    from pipeline.rollouts import from_parquet_bytes
    from tests.runs import make_base

    cfg = _distill_config(
        tiny_base, "model.hidden_size=32", "sft.steps=20", f"trainer.steps={STEPS}"
    )
    student = make_base(str(tmp_path / "student"), cfg)
    reference = clone_run(student, str(tmp_path / "reference"))
    procs = {n: start(reference, n, tmp_path / "logs") for n in ("trainer", "w0", "w1")}
    assert wait_all(procs, 240) == {"trainer": 0, "w0": 0, "w1": 0}
    kl = [r["reverse_kl"] for r in reference.read_metrics("train")]
    assert len(kl) == STEPS and min(map(abs, kl)) > 0.0, "the teacher must differ from the student"
    batch = from_parquet_bytes(reference.store.read("rollouts/b00000000.parquet"))
    assert batch.teacher_logprobs is not None and len(batch.teacher_logprobs) == len(batch)
    run = clone_run(student, str(tmp_path / "chaos"))
    result = _small_chaos(reference, run, failpoints="teacher.before_pin")
    assert result["failpoints_hit"] >= 1  # a worker died between the copy and the pin
    assert final_tensors(run)[0] == STEPS


# --------------------------------------------------------------------------------------
# Verified restores: a checkpoint whose bytes changed after the commit is refused
# --------------------------------------------------------------------------------------

# One file of each kind Orbax writes for a step (glob under checkpoints/<step>/).
CHECKPOINT_FILES = {
    "array data": "state/**/d/*",
    "ocdbt manifest": "state/manifest.ocdbt",
    "array metadata": "state/_METADATA",
    "json meta": "meta/metadata",
    "step metadata": "_CHECKPOINT_METADATA",
}


def _copy_with_checkpoints(reference, url: str):
    """The reference run without its trainer's done marker and weights: a trainer opened on
    it restores the newest checkpoint and replays the last steps from the same batches."""
    prefixes = ("data/", "base/", "rollouts/", "checkpoints/", "checkpoint_manifests/")
    return clone_run(reference, url, prefixes=prefixes)


def _flip(path, n: int = 4) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    path.write_bytes(bytes(data))


def _checkpoint_file(run_dir, step: int, kind: str):
    found = sorted((run_dir / "checkpoints" / str(step)).glob(CHECKPOINT_FILES[kind]))
    assert found, (kind, step)
    return max(found, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("kind", sorted(CHECKPOINT_FILES))
def test_a_checkpoint_with_flipped_bytes_is_refused_for_the_previous_one(reference, tmp_path, kind):
    from tpu_jobs.learning.checkpoints import TrainerCheckpoints
    from tpu_jobs.trainer import Trainer

    run = _copy_with_checkpoints(reference, str(tmp_path / "run"))
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps[-1] == STEPS and len(steps) == 2
    _flip(_checkpoint_file(tmp_path / "run", STEPS, kind))
    lines: list[str] = []
    template = Trainer(run, log=lambda m: None)._template
    _, meta = TrainerCheckpoints(run, log=lines.append).restore_latest(template)
    assert meta["step"] == steps[0]
    assert len(lines) == 1 and f"refused checkpoint {run.store.url}/checkpoints/{STEPS}" in lines[0]
    assert "changed since it was written" in lines[0]


def test_the_trainer_resumes_from_the_last_good_checkpoint_and_ends_bit_identical(
    reference, tmp_path
):
    """The probe's finding 2: four bytes flipped in a checkpoint data file were restored
    ("resumed from checkpoint at step 4", one value 2.6e34) and the final weights differed.
    Now the trainer refuses that step, resumes from the one before and replays the rest."""
    run = _copy_with_checkpoints(reference, str(tmp_path / "run"))
    _flip(_checkpoint_file(tmp_path / "run", STEPS, "array data"))
    codes = wait_all({"trainer": start(run, "trainer", tmp_path / "logs")}, 120)
    log = (tmp_path / "logs" / "trainer.log").read_text()
    assert codes == {"trainer": 0}, log
    assert f"refused checkpoint {run.store.url}/checkpoints/{STEPS}" in log
    assert f"resumed from checkpoint at step {STEPS - 2}" in log
    assert_bit_identical(final_tensors(reference)[1], final_tensors(run)[1])


def test_every_checkpoint_refused_is_an_error_naming_each(reference, tmp_path):
    from tpu_jobs.learning.checkpoints import CheckpointCorruptError, TrainerCheckpoints
    from tpu_jobs.trainer import Trainer

    run = _copy_with_checkpoints(reference, str(tmp_path / "run"))
    _flip(_checkpoint_file(tmp_path / "run", STEPS, "array data"))
    run.store.delete(f"checkpoint_manifests/{STEPS - 2:08d}.json")  # a kill before it
    template = Trainer(run, log=lambda m: None)._template
    with pytest.raises(CheckpointCorruptError) as err:
        TrainerCheckpoints(run, log=lambda m: None).restore_latest(template)
    assert f"step {STEPS}: " in str(err.value) and "changed since it was written" in str(err.value)
    assert f"step {STEPS - 2}: it has no content manifest" in str(err.value)
