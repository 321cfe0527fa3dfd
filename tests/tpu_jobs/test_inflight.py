"""In-flight rollout batches (`rollout.inflight_batches`): one engine stream makes several
batches, each committed once its own rows are done, and each the batch the one-at-a-time
worker makes (same prompts, keys, tokens and rewards; log-probs to the last bits, which
change with the rows beside a row: benchmarks/results/row_invariance.md)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.leases import BatchLeases
from pipeline.paramserver import ParamServer
from pipeline.rollouts import batch_key, from_parquet_bytes
from pipeline.run import base_server
from tests.runs import clone_run
from tpu_jobs.generate.engine import Engine, Request
from tpu_jobs.generate.inflight import InflightRollouts
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.model.transformer import init_model
from tpu_jobs.rollout_worker import RolloutWorker


def test_stream_hands_each_completion_over_as_it_finishes_and_feeds_on_demand():
    """Two feeds: the second is asked for only once the first is admitted and a slot is
    free; each row's completion equals `run`'s over the same requests."""
    cfg = load_config("configs/tiny.yaml").model
    model = init_model(cfg, 0)
    engine = Engine(cfg, pad_id=0, eos_id=2, max_slots=4, chunk=4)
    rng = np.random.default_rng(0)
    reqs = [
        Request([1, *rng.integers(3, cfg.vocab_size, 5).tolist()], np.array([0, i], np.uint32), n)
        for i, n in enumerate([3, 9, 5, 12, 4, 7])
    ]
    params = SamplingParams(12)
    want = engine.run(model, reqs, params)
    feeds = [reqs[:4], reqs[4:]]
    asked, done = [], {}

    def feed():
        asked.append(len(done))
        return feeds.pop(0) if feeds else []

    served = engine.stream(model, params, feed, done.__setitem__)
    assert served == 6 and sorted(done) == list(range(6))
    assert asked[0] == 0 and asked[1] >= 1  # the second feed came after a row finished
    for i, c in enumerate(want):
        assert done[i].tokens == c.tokens and done[i].stop_reason == c.stop_reason
        np.testing.assert_allclose(done[i].logprobs, c.logprobs, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def inflight_run(tiny_base, tmp_path_factory):
    """A run whose first three batches are pinned to v0 (max_staleness 2), v0 published."""
    cfg = tiny_base.config
    cfg = replace(
        cfg,
        trainer=cfg.trainer.replace(max_staleness=2),
        rollout=replace(cfg.rollout, inflight_batches=2),
    )
    run = clone_run(tiny_base, str(tmp_path_factory.mktemp("inflight") / "run"), cfg)
    ps = ParamServer(run.store)
    ps.publish(0, dict(base_server(run).pull(0).tensors), epoch=ps.acquire_epoch())
    return run


def test_a_stream_commits_the_batches_one_at_a_time_makes(inflight_run):
    worker = RolloutWorker(inflight_run, "w0", log=lambda m: None)
    lease = worker.claim()
    assert lease is not None and (lease.index, lease.version) == (0, 0)
    assert worker._ensure_version(0)
    InflightRollouts(worker, lease, time.time()).run()
    # Batches 0..2 are pinned to v0 (limit 3): one stream made all three.
    assert worker.batches_done == 3
    assert worker.leases.claim_next(0, "w1", 0, limit=3) is None
    for index in range(3):
        got = from_parquet_bytes(inflight_run.store.read(batch_key(index)))
        want = worker.generate_batch(index, 0)
        assert got.policy_version == 0 and got.batch_index == index
        assert got.prompt_ids == want.prompt_ids
        assert got.completion_ids == want.completion_ids
        np.testing.assert_array_equal(got.reward, want.reward)
        np.testing.assert_array_equal(got.finished, want.finished)
        for a, b in zip(got.behaviour_logprobs, want.behaviour_logprobs, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_leases_held_by_a_stream_stay_alive_past_their_time_to_live(tiny_base, tmp_path):
    """Leases of half a second over a stream of seconds (each commit takes 0.3 s, as on a
    slow store): another worker trying the stream's batches all along never gets one (the
    heartbeat renews them while they wait for slots and for their commit)."""
    cfg = tiny_base.config
    cfg = replace(
        cfg,
        trainer=cfg.trainer.replace(max_staleness=5, steps=6),  # 6 batches, all on v0
        rollout=replace(cfg.rollout, inflight_batches=2, lease_seconds=0.5),
    )
    run = clone_run(tiny_base, str(tmp_path / "run"), cfg)
    ps = ParamServer(run.store)
    ps.publish(0, dict(base_server(run).pull(0).tensors), epoch=ps.acquire_epoch())
    worker = RolloutWorker(run, "w0", log=lambda m: None)
    lease = worker.claim()
    assert worker._ensure_version(0)
    commit = worker.commit

    def slow_commit(*args):  # a slow store: finished batches wait for their commit
        time.sleep(0.3)
        commit(*args)

    worker.commit = slow_commit
    stream = InflightRollouts(worker, lease, time.time())
    other = BatchLeases(run.store, ttl_seconds=0.5)
    taken, tries, done = [], [0], threading.Event()

    def intrude():
        while not done.is_set():
            for index in list(stream.held):
                tries[0] += 1
                got = other.claim_next(index, "intruder", 0, limit=index + 1)
                if got is not None and not other.batch_exists(index):
                    taken.append(index)
            time.sleep(0.05)

    thread = threading.Thread(target=intrude)
    thread.start()
    began = time.monotonic()
    try:
        stream.run()
    finally:
        done.set()
        thread.join()
    assert time.monotonic() - began > 1.0, "the stream was too short to test the leases"
    assert tries[0] > 5 and taken == []
    assert worker.batches_done == 6


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("sampler.engine=static", "sampler.engine='static'"),
        ("rollout.judge_fraction=0.25", "rollout.judge_fraction=0.25"),
        ("trainer.dynamic_sampling=true", "trainer.dynamic_sampling=True"),
        ("rollout.sample_chunks=2", "rollout.sample_chunks=2"),
    ],
)
def test_inflight_batches_refuse_what_waits_on_a_batch_s_rewards(override, named):
    with pytest.raises(ConfigError, match=f"inflight_batches=2 cannot be used with {named}"):
        load_config("configs/tiny.yaml", ["rollout.inflight_batches=2", override])


def test_inflight_batches_refuse_a_distillation_teacher():
    with pytest.raises(ConfigError, match="cannot be used with distill.teacher="):
        load_config("configs/demo_distill.yaml", ["rollout.inflight_batches=2"])
