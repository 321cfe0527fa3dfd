"""Evaluation beyond pass@k: Self-PRM reranking, the ORM baseline, `--k`, the report and
the TensorBoard export, on one small stored run built once per module.

The run: tiny config, a base model (SFT with 0 steps: the seeded initialisation, published
as `base/` v0 and weights v0), planted labelled rollout batches (correct solutions are
written with the letters "klm", wrong ones with "uvw"; 1 in 4 correct), the ORM trained on
them, version 0 evaluated for real (sampling, self-scores, ORM scores), and versions 1-2
as per-sample tables with planted correctness and scores summarised by the evaluator's
own `summarise_table` (a random model solves nothing, which would leave the judge
statistics empty), plus a few trainer records.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.paramserver import ParamServer
from pipeline.parquet_bytes import table_from_bytes
from pipeline.rollouts import RolloutBatch, to_parquet_bytes
from pipeline.run import Run
from pipeline.tokenizer import get_tokenizer
from tests.runs import tiny_config

SIGNAL = {True: "klm", False: "uvw"}


def planted_batches(run: Run, batches: int = 6, rows: int = 32, seed: int = 0) -> int:
    """Write rollout batches whose label is readable from the solution's letters; the last
    batch also holds 8 learning-to-judge rows (which the ORM must skip). Returns the
    number of solve rows."""
    tok = get_tokenizer("char")
    problems = run.read_problems("train")
    rng = np.random.default_rng(seed)
    solve = 0
    for b in range(batches):
        judge_rows = 8 if b == batches - 1 else 0
        pids, prompts, comps, texts, rewards, kinds = [], [], [], [], [], []
        for r in range(rows):
            p = problems[int(rng.integers(0, len(problems)))]
            correct = bool(rng.random() < 0.25)
            text = "".join(rng.choice(list(SIGNAL[correct]), int(rng.integers(3, 9))))
            kind = "judge" if r < judge_rows else "solve"
            pids.append(p.problem_id)
            prompts.append(tok.encode_prompt(p.prompt))
            comps.append(tok.encode_completion(text))
            texts.append(text)
            rewards.append(1.0 if correct else 0.0)
            kinds.append(kind)
            solve += kind == "solve"
        batch = RolloutBatch(
            batch_index=b,
            prompt_pos=np.arange(rows, dtype=np.int32),
            prompt_id=pids,
            task=["arithmetic"] * rows,
            sample_index=np.zeros(rows, np.int32),
            prompt_ids=prompts,
            completion_ids=comps,
            behaviour_logprobs=[[0.0] * len(c) for c in comps],
            completion=texts,
            finished=np.ones(rows, bool),
            reward=np.asarray(rewards, np.float32),
            policy_version=0,
            worker_id="planted",
            kind=kinds,
        )
        run.store.write_new(f"rollouts/b{b:08d}.parquet", to_parquet_bytes(batch))
    return solve


def planted_table(ev, version: int, seed: int) -> pa.Table:
    """A per-sample table as the evaluator writes it, with planted correctness (rising
    with the version) and self / ORM scores that mostly agree with it."""
    rng = np.random.default_rng(seed)
    p, n = len(ev.problems), ev.n
    rate = rng.uniform(0, 1, p) * (0.5 + 0.25 * version)
    correct = rng.random((p, n)) < rate[:, None]
    self_score = 0.4 * correct + 0.6 * rng.random((p, n))  # right about 2/3 of the time
    orm_score = 0.5 * correct + 0.5 * rng.random((p, n))
    answers = [
        [ev.problems[i].answer if correct[i, s] else str(s % 2) for s in range(n)] for i in range(p)
    ]
    return pa.table(
        {
            "version": np.full(p * n, version, np.int64),
            "problem_id": [ev.problems[i].problem_id for i in range(p) for _ in range(n)],
            "task": [ev.problems[i].task for i in range(p) for _ in range(n)],
            "sample_index": np.tile(np.arange(n, dtype=np.int32), p),
            "completion": ["#" + a for row in answers for a in row],
            "answer": [a for row in answers for a in row],
            "reference": [ev.problems[i].answer for i in range(p) for _ in range(n)],
            "reward": correct.reshape(-1).astype(np.float32),
            "num_tokens": np.full(p * n, 4, np.int32),
            "self_score": self_score.reshape(-1).astype(np.float32),
            "orm_score": orm_score.reshape(-1).astype(np.float32),
        }
    )


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    from pipeline.problem_sets import write_data
    from pipeline.run import base_server
    from tpu_jobs.evaluator import Evaluator
    from tpu_jobs.orm import train_orm
    from tpu_jobs.sft import train_sft

    cfg = tiny_config(
        "sft.steps=0",
        "sampler.max_new_tokens=16",
        "eval.num_problems=8",
        "eval.num_samples=4",
        "eval.ks=[1,4]",
        "eval.bootstrap=100",
        "eval.batch_size=64",
        "eval.orm_steps=150",
        "eval.orm_batch_size=32",
        "eval.orm_lr=3e-3",
        "eval.orm_holdout=0.3",
    )
    run = Run.create(str(tmp_path_factory.mktemp("eval-run") / "run"), cfg)
    write_data(run)
    train_sft(run)
    ps = ParamServer(run.store)
    ps.publish(0, dict(base_server(run).pull(0).tensors), epoch=ps.acquire_epoch())
    solve_rows = planted_batches(run)
    logs: list[str] = []
    orm = train_orm(run, log=logs.append)
    ev = Evaluator(run, log=logs.append)
    real = ev.evaluate(0)
    for v in (1, 2):
        table = planted_table(ev, v, seed=v)
        sink = io.BytesIO()
        pq.write_table(table, sink)
        run.store.write_new(ev.samples_key(v), sink.getvalue())
        record = ev.summarise_table(v, table)
        run.log_metrics("eval", v, record)
    for step in range(1, 4):
        run.log_metrics(
            "train",
            step,
            {"step": step, "reward_mean": 0.1 * step, "loss": -0.5 * step, "kl": 0.01 * step},
        )
    return {"run": run, "orm": orm, "real": real, "solve_rows": solve_rows, "logs": logs}


def test_self_prm_reranking_on_constructed_scores():
    from tpu_jobs.evaluator import summarise_samples

    correct = np.array(
        [[False, True, False, True], [False, False, False, True], [True, False, False, False]]
    )
    answers = [["1", "2", "1", "2"], ["3", "3", "4", "5"], ["6", "7", "7", "8"]]
    rewards = correct.astype(np.float32)
    self_s = np.array(
        [
            [0.2, 0.9, 0.5, 0.9],  # k=4: tie 0.9 at samples 1 and 3 -> earliest (1): correct
            [0.8, 0.1, 0.1, 0.7],  # k=4: sample 0 (wrong) beats the correct sample 3
            [0.3, 0.3, 0.3, 0.3],  # all tied -> sample 0: correct
        ]
    )
    perfect = correct.astype(float)
    out = summarise_samples(
        correct,
        answers,
        rewards,
        (1, 2, 4),
        n_boot=50,
        seed=0,
        scores={"self_prm": self_s, "orm": perfect},
    )
    # self_prm@1 is the first sample's correctness; @2 the better of the first two.
    assert out["self_prm@1"]["mean"] == pytest.approx(np.mean([0, 0, 1]))
    assert out["self_prm@2"]["mean"] == pytest.approx(np.mean([1, 0, 1]))
    assert out["self_prm@4"]["mean"] == pytest.approx(np.mean([1, 0, 1]))
    # A perfect scorer reaches the upper bound: any correct among the first k.
    for k in (1, 2, 4):
        bound = correct[:, :k].any(axis=1).mean()
        assert out[f"orm@{k}"]["mean"] == pytest.approx(bound)
        assert out[f"orm@{k}"]["mean"] >= out[f"self_prm@{k}"]["mean"]
    assert out["maj@4"]["mean"] == pytest.approx(np.mean([0, 0, 0]))  # "1"/"2" tie -> "1"
    # Paired with the vote per problem: self_prm@4 [1, 0, 1] - maj@4 [0, 0, 0].
    assert out["self_prm_vs_maj@4"]["mean"] == pytest.approx(2 / 3)
    assert out["self_prm_vs_maj@4"]["lo"] >= 0.0  # no problem where the vote wins
    # Judge accuracy (score > 0.5): row 0 right on 0, 1, 3 (0.5 is "no", wrong) = 3/4 ...
    acc = ((self_s > 0.5) == correct).mean()
    assert out["judge_accuracy"]["mean"] == pytest.approx(acc)
    assert out["orm_accuracy"]["mean"] == 1.0 and out["orm_auc"]["mean"] == 1.0
    assert 0.0 <= out["judge_auc"]["lo"] <= out["judge_auc"]["mean"] <= 1.0
    # Within-problem AUC: row 0 correct {0.9, 0.9} vs wrong {0.2, 0.5} = 1; row 1 correct
    # 0.7 vs wrong {0.8, 0.1, 0.1} = 2/3; row 2 all tied = 1/2.
    assert out["judge_auc_within"]["mean"] == pytest.approx((1 + 2 / 3 + 1 / 2) / 3)
    assert out["orm_auc_within"]["mean"] == 1.0


def test_self_confidence_ranks_without_a_verdict():
    """A confidence (a log-prob, not a probability) reranks and has AUCs, but no accuracy
    at the judge threshold and no judge report."""
    from tpu_jobs.evaluator import judge_report, summarise_samples

    correct = np.array([[False, True, True, False], [True, False, False, False]])
    answers = [["1", "2", "2", "1"], ["3", "4", "4", "5"]]
    conf = np.array([[-2.0, -0.5, -0.7, -3.0], [-1.0, -0.2, -0.9, -4.0]])
    out = summarise_samples(
        correct,
        answers,
        correct.astype(np.float32),
        (2, 4),
        n_boot=50,
        seed=0,
        scores={"self_conf": conf},
    )
    # k=2: problem 0 picks sample 1 (right), problem 1 sample 1 (wrong); k=4 the same picks.
    assert out["self_conf@2"]["mean"] == pytest.approx(0.5)
    assert out["self_conf@4"]["mean"] == pytest.approx(0.5)
    # maj@4: problem 0 "1"/"2" tie -> "1" (wrong); problem 1 "4" (wrong).
    assert out["self_conf_vs_maj@4"]["mean"] == pytest.approx(0.5)
    # Within problem 0 both right samples outrank both wrong ones; problem 1 1/3 of pairs.
    assert out["conf_auc_within"]["mean"] == pytest.approx((1 + 1 / 3) / 2)
    assert "conf_accuracy" not in out and "conf_auc" in out
    assert judge_report({"self_conf": conf}, correct) == {}


def test_orm_learns_planted_labels_and_is_idempotent(small_run):
    from pipeline.run import orm_server
    from tpu_jobs.orm import train_orm

    run, orm = small_run["run"], small_run["orm"]
    assert orm["train_rows"] + orm["val_rows"] == small_run["solve_rows"]  # judge rows skipped
    assert orm["init"] == "base" and orm["val_rows"] > 0
    # Honest bar: held-out balanced accuracy / AUC well above chance (0.5), loss down.
    assert orm["val"]["balanced_accuracy"] > 0.75, orm
    assert orm["val"]["auc"] > 0.85, orm
    assert orm["val"]["loss"] < orm["val_before"]["loss"]
    assert orm["train_loss_last"] < orm["train_loss_first"]
    server = orm_server(run)
    manifest = server.manifest(0)
    again = train_orm(run, log=lambda m: None)  # the stored summary record, nothing retrained
    assert {k: v for k, v in again.items() if k not in ("index", "time")} == orm
    assert server.versions() == [0] and server.manifest(0) == manifest
    assert len(run.read_metrics("orm")) == 1


def test_real_evaluation_has_self_and_orm_scores(small_run):
    run, rec = small_run["run"], small_run["real"]
    table = table_from_bytes(run.store.read("eval/v00000000.parquet")).to_pydict()
    n_rows = rec["num_problems"] * rec["num_samples"]
    for col in ("self_score", "orm_score"):
        s = np.asarray(table[col])
        assert s.shape == (n_rows,) and np.all((s >= 0) & (s <= 1))
    assert "self_conf@4" in rec["metrics"] and "self_conf_vs_maj@4" in rec["metrics"]
    assert rec["self_conf"] == "mean"  # the aggregate behind the stored column
    for name in ("pass@4", "maj@4", "self_prm@1", "self_prm@4", "orm@4", "judge_accuracy"):
        m = rec["metrics"][name]
        assert 0.0 <= m["lo"] <= m["mean"] <= m["hi"] <= 1.0
    assert set(rec["judge"]) == {"self_prm", "orm"}
    assert set(rec["judge"]["self_prm"]["by_difficulty"]) == {"hard", "medium", "easy"}
    # The stored scores are the evaluator's own: judge_accuracy recomputes from them.
    correct = np.asarray(table["reward"]) >= 1
    acc = float(((np.asarray(table["self_score"]) > 0.5) == correct).mean())
    assert rec["metrics"]["judge_accuracy"]["mean"] == pytest.approx(acc)


def test_self_confidence_is_the_mean_log_prob_of_the_samples_own_tokens(small_run):
    """The stored conf_score against an independent teacher-forced pass of the evaluated
    version over prompt + completion (`sequence_logprobs`), on every sample whose text gives
    back its tokens: no token that decodes to nothing or to UNK (a random model samples
    those), and EOS at its end unless it stopped at the token limit."""
    import jax.numpy as jnp

    from pipeline.run import policy_reader
    from pipeline.tokenizer.run import run_tokenizer
    from tpu_jobs.model.state import flat_to_params, new_model
    from tpu_jobs.model.transformer import sequence_logprobs

    run = small_run["run"]
    table = table_from_bytes(run.store.read("eval/v00000000.parquet")).to_pydict()
    problems = {p.problem_id: p for p in run.read_problems("eval")}
    tok = run_tokenizer(run)
    fns, params = new_model(run.config.model, run.config.seed)
    model = fns.merge(flat_to_params(fns, params, policy_reader(run).pull(0).tensors))
    limit = run.config.sampler.max_new_tokens
    checked = 0
    for pid, text, n, conf in zip(
        table["problem_id"],
        table["completion"],
        table["num_tokens"],
        table["conf_score"],
        strict=True,
    ):
        completion = tok.encode(text) if n == limit else tok.encode_completion(text)
        if len(completion) != n or tok.unk_id in completion:
            continue
        prompt = tok.encode_prompt(problems[pid].prompt)
        tokens = jnp.asarray([prompt + completion])
        lp = sequence_logprobs(model, tokens, jnp.ones_like(tokens), run.config.eval.temperature)
        assert conf == pytest.approx(float(lp[0, len(prompt) :].mean()), abs=1e-4)
        checked += 1
    assert checked >= 3, checked


def test_eval_k_option_new_key_idempotent_and_resummarised(small_run, capsys):
    from tpu_jobs.evaluator import main

    run = small_run["run"]
    assert main(["--run", run.url, "--version", "0", "--k", "1,2,8"]) == 0
    rec = run.read_metrics("eval-n8-k1_2_8")
    assert [r["version"] for r in rec] == [0] and rec[0]["num_samples"] == 8
    assert {"pass@8", "maj@2", "self_prm@8", "orm@8"} <= set(rec[0]["metrics"])
    assert run.store.exists("eval/v00000000-n8.parquet")
    # The default record of v0 (n=4) is untouched; the first 4 samples are the same keys.
    default = table_from_bytes(run.store.read("eval/v00000000.parquet")).to_pydict()
    big = table_from_bytes(run.store.read("eval/v00000000-n8.parquet")).to_pydict()
    first4 = [c for c, s in zip(big["completion"], big["sample_index"], strict=True) if s < 4]
    assert first4 == default["completion"]
    capsys.readouterr()
    assert main(["--run", run.url, "--version", "0", "--k", "1,2,8"]) == 0
    assert "already evaluated" in capsys.readouterr().out
    # Same n, other ks: summarised from the stored samples, nothing sampled again.
    assert main(["--run", run.url, "--version", "0", "--k", "1,8"]) == 0
    out = capsys.readouterr().out
    assert "summarising stored eval/v00000000-n8.parquet" in out
    again = run.read_metrics("eval-n8-k1_8")[0]["metrics"]
    assert again["pass@8"] == rec[0]["metrics"]["pass@8"]
    with pytest.raises(SystemExit, match="--k"):
        main(["--run", run.url, "--k", "0,2"])


def test_report_renders_every_metric_and_plot(small_run):
    from pipeline.report import build_report, eval_streams

    run = small_run["run"]
    md = build_report(run)
    for key in (
        "report/curves.png",
        "report/metrics_vs_k.png",
        "report/judge_buckets.png",
        "report/judge_vs_pass.png",
    ):
        data = run.store.read(key)
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, key
        assert key.split("/")[1] in md
    names = {n for rs in eval_streams(run).values() for r in rs for n in r["metrics"]}
    assert {"pass@1", "maj@4", "self_prm@4", "orm@4", "judge_accuracy", "judge_auc"} <= names
    for n in names:
        assert n in md, n
    for word in ("precision", "recall", "hard", "medium", "easy", "ORM baseline", "co-evolution"):
        assert word in md, word
    # The local run's TensorBoard directory is refreshed by the report.
    assert list((run_dir(run) / "tensorboard" / "eval").glob("events.out.tfevents.*"))


def run_dir(run: Run):
    from pipeline.storage import local_path

    return local_path(run.store.url)


def test_tensorboard_export_reads_back(small_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipeline.tb_export import export

    run = small_run["run"]
    logdir = tmp_path / "tb"
    (logdir / "train").mkdir(parents=True)
    (logdir / "train" / "events.out.tfevents.0.stale").write_bytes(b"")  # a previous export
    n = export(run, logdir, log=lambda m: None)
    assert n == len(run.store.list("metrics/")) and n > 0
    assert not (logdir / "train" / "events.out.tfevents.0.stale").exists()

    def scalars(stream, tag):
        acc = EventAccumulator(str(logdir / stream))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    train = sorted(run.read_metrics("train"), key=lambda r: r["step"])
    got = scalars("train", "train/reward_mean")
    assert [s for s, _ in got] == [r["step"] for r in train]
    np.testing.assert_allclose([v for _, v in got], [r["reward_mean"] for r in train], rtol=1e-6)
    assert [v for _, v in scalars("train", "train/kl")] == pytest.approx([0.01, 0.02, 0.03])
    evals = sorted(run.read_metrics("eval"), key=lambda r: r["version"])
    for name, field, tag in (
        ("pass@1", "mean", "eval/pass_at_1"),
        ("self_prm@4", "lo", "eval/self_prm_at_4/lo"),
    ):
        got = scalars("eval", tag)
        assert [s for s, _ in got] == [e["version"] for e in evals]
        np.testing.assert_allclose(
            [v for _, v in got], [e["metrics"][name][field] for e in evals], rtol=1e-6
        )
    hard = scalars("eval", "eval/judge/self_prm/by_difficulty/hard/samples")
    assert [v for _, v in hard] == [
        e["judge"]["self_prm"]["by_difficulty"]["hard"]["samples"] for e in evals
    ]
    assert scalars("orm", "orm/val/accuracy")[0][1] == pytest.approx(
        small_run["orm"]["val"]["accuracy"], rel=1e-6
    )
    # Exporting again rewrites from scratch: one event file per stream, same points.
    export(run, logdir, log=lambda m: None)
    assert len(list((logdir / "train").glob("events.out.tfevents.*"))) == 1
    assert len(scalars("train", "train/reward_mean")) == len(train)


def test_orm_role_and_tensorboard_command_are_wired():
    from pipeline.ops import launcher
    from pipeline.ops.cli import build_parser

    assert launcher.JOBS["orm"] == "tpu_jobs.orm"
    assert launcher.job_command("orm", "runs/x")[2] == "tpu_jobs.orm"
    args = build_parser().parse_args(["tensorboard", "--run", "runs/x", "--follow"])
    assert args.follow and args.logdir is None and args.func.__name__ == "cmd_tensorboard"


def test_self_prm_and_self_confidence_can_be_turned_off(small_run):
    import dataclasses

    from pipeline.config import ConfigError
    from tpu_jobs.evaluator import Evaluator

    run = small_run["run"]
    cfg = run.config
    off = dataclasses.replace(
        cfg, eval=dataclasses.replace(cfg.eval, self_prm=False, self_conf="none")
    )
    ev = Evaluator(Run(url=run.url, store=run.store, config=off), log=lambda m: None)
    ev.policy.load(ev.reader.pull(0))
    table = ev._sample_and_score(0, ev.policy)
    assert "orm_score" in table.column_names
    assert "self_score" not in table.column_names and "conf_score" not in table.column_names
    rec = ev.summarise_table(0, table)
    assert "self_prm@4" not in rec["metrics"] and "orm@4" in rec["metrics"]
    assert "self_conf@4" not in rec["metrics"]
    assert set(rec["judge"]) == {"orm"}
    assert tiny_config("eval.self_prm=false").eval.self_prm is False
    for bad, field in (
        ("eval.orm_preset=huge", "eval.orm_preset"),
        ("eval.orm_holdout=1", "eval.orm_holdout"),
        ("eval.self_prm=maybe", "eval.self_prm"),
        ("eval.self_conf=median", "eval.self_conf"),
    ):
        with pytest.raises(ConfigError, match=field):
            tiny_config(bad)


def test_tensorboard_follow_until_done_and_out_of_order_rewrite(tmp_path):
    import threading
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipeline.run import DONE_KEY
    from pipeline.tb_export import export

    run = Run.create(str(tmp_path / "run"), tiny_config())
    run.log_metrics("train", 2, {"step": 2, "reward_mean": 0.2})
    logs: list[str] = []
    t = threading.Thread(
        target=export,
        args=(run, tmp_path / "tb"),
        kwargs={"follow": True, "poll_s": 0.05, "log": logs.append},
    )
    t.start()
    time.sleep(0.5)
    run.log_metrics("train", 3, {"step": 3, "reward_mean": 0.3})
    time.sleep(0.5)
    run.log_metrics("train", 1, {"step": 1, "reward_mean": 0.1})  # out of order
    time.sleep(0.5)
    run.store.write_new(DONE_KEY, b"{}")
    t.join(timeout=20)
    assert not t.is_alive()
    assert any("out of order" in m for m in logs)
    acc = EventAccumulator(str(tmp_path / "tb" / "train"))
    acc.Reload()
    got = [(e.step, round(e.value, 6)) for e in acc.Scalars("train/reward_mean")]
    assert got == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert len(list((tmp_path / "tb" / "train").glob("events.out.tfevents.*"))) == 1


def test_eval_on_a_built_in_dataset_has_keys_of_its_own(small_run, monkeypatch):
    from pipeline.tasks import datasets
    from pipeline.tasks.base import make_problem
    from tpu_jobs.evaluator import eval_key, eval_stream, main

    assert eval_key(3, 4, 4, "humaneval") == "eval/v00000003-humaneval.parquet"
    assert eval_key(3, 8, 4, "humaneval") == "eval/v00000003-humaneval-n8.parquet"
    assert eval_stream(4, (1, 4), 4, (1, 4), "humaneval") == "eval-humaneval"
    assert eval_stream(8, (1, 8), 4, (1, 4), "humaneval") == "eval-humaneval-n8-k1_8"
    # HumanEval's prompts are longer than the tiny model's context: two short code
    # problems stand in for it, through the same registry and the real sandbox.
    tiny = [
        make_problem("code", f"print {i}", str(i), {"io": [{"stdin": "", "stdout": str(i)}]})
        for i in range(2)
    ]
    monkeypatch.setitem(datasets.DATASETS, "tiny_code", lambda: tiny)
    run = small_run["run"]
    before = run.read_metrics("eval")
    assert main(["--run", run.url, "--version", "0", "--dataset", "tiny_code"]) == 0
    (record,) = run.read_metrics("eval-tiny_code")
    assert record["num_problems"] == 2 and set(record["per_task"]) == {"code"}
    assert {"pass@1", "pass@4", "maj@4"} <= set(record["metrics"])
    table = table_from_bytes(run.store.read("eval/v00000000-tiny_code.parquet"))
    assert set(table.column("problem_id").to_pylist()) == {p.problem_id for p in tiny}
    assert run.read_metrics("eval") == before  # the held-out records are untouched
    with pytest.raises(SystemExit):
        main(["--run", run.url, "--dataset", "no_such_set"])
