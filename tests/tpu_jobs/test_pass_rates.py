"""Pass rates: the aggregation against an independent count (a stub sampler whose
correctness per sample is a known function of its key), and one real tiny-model run."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.paramserver import ParamServer
from pipeline.parquet_bytes import table_from_bytes
from pipeline.run import Run
from pipeline.tasks import TASKS
from pipeline.tasks.mix import build_splits
from pipeline.tokenizer import get_tokenizer
from tpu_jobs import pass_rates as pr
from tpu_jobs.generate import policy
from tpu_jobs.generate.interface import SampleResult
from tpu_jobs.generate.sample_verify import PASS_RATE_STREAM, sample_keys
from tpu_jobs.model.transformer import flat_params, init_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_with_weights(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pass-rates")
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    run = Run.create(str(tmp / "run"), cfg)
    ps = ParamServer(run.store)
    epoch = ps.acquire_epoch()
    ps.publish(3, flat_params(init_model(cfg.model, cfg.seed)), epoch=epoch)
    train, _ = build_splits(cfg.task)
    problems = sorted(train[:10], key=lambda p: p.problem_id)
    rows = [{**p.to_dict(), "meta": json.dumps(p.meta)} for p in problems]
    pq.write_table(pa.Table.from_pylist(rows[:6]), tmp / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[6:] + rows[:1]), tmp / "b.parquet")  # a repeat
    return run, problems, tmp


def _key_rule(key_data: np.ndarray) -> bool:
    return int(key_data[0]) % 3 != 0


class StubSampler:
    """Writes the correct worked solution when the sample's key passes `_key_rule`."""

    problems: list = []

    def __init__(self, cfg, pad_id, eos_id, mesh=None, kv_token_budget=0):
        self.tok = get_tokenizer("char")
        self.by_prompt = {tuple(self.tok.encode_prompt(p.prompt)): p for p in self.problems}

    def generate(
        self,
        model,
        prompts,
        keys,
        params,
    ):
        data = np.asarray(jax.random.key_data(keys))
        texts = []
        for prompt, kd in zip(prompts, data, strict=True):
            p = self.by_prompt[tuple(prompt)]
            task = TASKS[p.task]
            perfect = task.noiseless(task.Options())
            good = task.teacher_solution(p, np.random.default_rng(0), perfect)
            texts.append(good if _key_rule(kd) else "#wrong")
        width = max(len(t) for t in texts) + 1
        tokens = np.zeros((len(texts), width), np.int32)
        lengths = np.zeros(len(texts), np.int32)
        for i, t in enumerate(texts):
            ids = self.tok.encode_completion(t)
            tokens[i, : len(ids)] = ids
            lengths[i] = len(ids)
        return SampleResult(
            tokens, np.zeros(tokens.shape, np.float32), lengths, np.ones(len(texts), bool)
        )


def test_pass_rates_count_correct_samples_per_problem(run_with_weights, monkeypatch):
    run, problems, _ = run_with_weights
    StubSampler.problems = problems
    monkeypatch.setattr(policy, "make_sampler", lambda cfg, tok, mesh: StubSampler(cfg.model, 0, 2))
    k = 5
    table = pr.pass_rates(
        run, problems, k, None, batch_size=7, log=lambda *_: None
    )  # 7: splits problems
    keys = np.asarray(
        jax.random.key_data(sample_keys(run.config.seed, PASS_RATE_STREAM, 3, 0, len(problems), k))
    )
    expected = [sum(_key_rule(keys[i * k + s]) for s in range(k)) for i in range(len(problems))]
    assert table.schema == pr.SCHEMA
    assert table.column("problem_id").to_pylist() == [p.problem_id for p in problems]
    assert table.column("num_correct").to_pylist() == expected
    np.testing.assert_allclose(table.column("pass_rate").to_numpy(), np.array(expected) / k)
    assert set(table.column("version").to_pylist()) == {3}
    assert set(table.column("k").to_pylist()) == {k}
    assert 0 < sum(expected) < k * len(problems)  # the rule gives a mix of outcomes


def test_cli_real_model_writes_once(run_with_weights, capsys):
    run, problems, tmp = run_with_weights
    argv = ["--run", run.url, "--data", str(tmp / "*.parquet"), "--k", "2", "--batch-size", "8"]
    assert pr.main(argv) == 0
    key = pr.default_key(3, 2, problems)
    table = table_from_bytes(run.store.read(key))
    assert sorted(table.column("problem_id").to_pylist()) == [p.problem_id for p in problems]
    rates = table.column("pass_rate").to_numpy()
    assert np.all((rates == 0) | (rates == 0.5) | (rates == 1))
    for name in ("problem_id", "pass_rate", "k", "version"):  # what beam_jobs.curate reads
        assert name in table.column_names
    capsys.readouterr()
    assert pr.main(argv) == 0  # create-only: the second call finds the file
    assert "nothing to do" in capsys.readouterr().out
