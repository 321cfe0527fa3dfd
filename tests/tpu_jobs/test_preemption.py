"""Preemption: resume equals a straight run, SIGKILL mid-checkpoint and mid-batch lose
nothing, and a small chaos run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from pipeline.chaos import ChaosSettings, account, final_params_equal, run_with_chaos
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
    from tpu_jobs.checkpoints import TrainerCheckpoints
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


def test_small_chaos_run(reference, tmp_path):
    run = clone_run(reference, str(tmp_path / "run"))
    settings = ChaosSettings(kills=4, min_interval_s=2.0, max_interval_s=5.0, seed=3, timeout_s=400)
    stats = run_with_chaos(run, settings, log=lambda m: None)
    result = account(run, stats)
    identical, why = final_params_equal(reference, run)
    assert identical, why
    assert result["batches_lost"] == 0 and result["batches_produced_twice"] == 0
    assert result["batches_consumed"] == STEPS
    assert not result["latest_moved_backwards"]
    assert result["kills_total"] >= 2
