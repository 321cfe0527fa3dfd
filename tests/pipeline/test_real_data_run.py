"""Real data end to end: a GSM8K-format file and a MATH-format file go through the Beam
curation job (`python -m beam_jobs.curate`), become the run's problem sets in the `math`
family, a tiny Hugging Face model (its own byte-level BPE tokenizer) is imported, RL runs
with rewards judged by math-verify in the sandbox, and the evaluator scores the versions.

The run from scratch with the char tokenizer is refused first: MATH text has upper case,
backslashes and braces the char tokenizer cannot write, and they must never become UNK."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dags.params import config_from_params
from pipeline.entrypoint import BAD_INPUT
from pipeline.layout import CURATED_PREFIX
from pipeline.ops import launcher
from pipeline.rollouts import from_parquet_bytes
from pipeline.run import Run
from pipeline.sandbox.isolation import userns_forbidden
from pipeline.tasks import get_task
from tests.runs import start, wait_all

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_FORBIDDEN = userns_forbidden()
pytestmark = [  # ~1 CPU-minute: .ci/run's e2e lane, not make test
    pytest.mark.e2e,
    pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox here: {_FORBIDDEN}"),
]

TINY = {"config_file": "configs/tiny.yaml", "storage_root": "runs", "task_families": ["math"]}
SMALL = [
    "trainer.steps=2",
    "trainer.checkpoint_every=1",
    "trainer.max_staleness=2",
    "sampler.max_new_tokens=24",
    "rollout.prompts_per_batch=4",
    "rollout.group_size=4",
    "eval.num_problems=6",
    "eval.num_samples=4",
    "eval.ks=[1,4]",
]
MATH_GOLDS = ["\\frac{1}{2}", "(3, \\frac{\\pi}{2})", "[2, 5)", "28\\%", "\\sqrt{2}", "-7"]


def _sources(tmp: Path) -> list[str]:
    gsm8k = [
        {
            "question": f"Tom has {a} Apples and buys {b} more. How many Apples does he have?",
            "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b:,}",
        }
        for a, b in zip(range(11, 35), range(1020, 1044), strict=True)
    ]
    math = [
        {
            "problem": f"Problem {i}: compute the value $V_{{{i}}}$ described in Section {i}.",
            "solution": f"By Theorem {i}, the answer is $\\boxed{{{MATH_GOLDS[i % len(MATH_GOLDS)]}}}$.",
            "level": f"Level {1 + i % 5}",
            "type": "Algebra",
        }
        for i in range(24)
    ]
    paths = []
    for name, rows in (("gsm8k.jsonl", gsm8k), ("math.jsonl", math)):
        path = tmp / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return paths


def _tiny_qwen2(path: Path, corpus: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    tcfg = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    config = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|endoftext|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _curate(run: Run, sources: list[str]) -> None:
    out = run.store.url_of(CURATED_PREFIX)
    cmd = launcher.curate_command(sources, out, options={"val_fraction": 0.25, "seed": 0})
    launcher.stream(cmd, name="curate")


def _data_job(run: Run):
    import subprocess

    cmd = launcher.job_command("data", run.url, ("--curated",))
    return subprocess.run(cmd, capture_output=True, text=True, env=launcher.job_env())


def test_curated_gsm8k_and_math_through_rl_and_eval(tmp_path):
    sources = _sources(tmp_path)

    # From scratch with the char tokenizer: refused with BAD_INPUT, naming the characters.
    char_run = Run.create(str(tmp_path / "char-run"), config_from_params(TINY))
    _curate(char_run, sources)
    done = _data_job(char_run)
    assert done.returncode == BAD_INPUT, done.stdout + done.stderr
    assert "cannot represent" in done.stdout and "model.tokenizer=byte" in done.stdout
    for c in "ATPV\\{}":
        assert c in done.stdout.split("characters of these problems, ")[1].split(" (first")[0]
    assert not char_run.has_problems("train")

    # A pretrained model with its own tokenizer: the DAG's hf_checkpoint path.
    corpus = [line for src in sources for line in Path(src).read_text().splitlines()]
    model_dir = _tiny_qwen2(tmp_path / "qwen2", corpus * 3)
    cfg = config_from_params(
        {**TINY, "hf_checkpoint": str(model_dir)},
        [*launcher.hf_model_overrides(str(model_dir)), *SMALL],
    )
    run = Run.create(str(tmp_path / "run"), cfg)
    _curate(run, sources)
    done = _data_job(run)
    assert done.returncode == 0, done.stdout + done.stderr
    train, held_out = run.read_problems("train"), run.read_problems("eval")
    assert {p.task for p in train + held_out} == {"math"}
    golds = {p.answer for p in train + held_out}
    assert {"1,031", "\\frac{1}{2}", "[2, 5)"} & golds  # GSM8K's as written, MATH's boxed
    launcher.stream(launcher.hf_import_command(str(model_dir), run.url), name="hf-import")
    assert Run.open(run.url).config.model.tokenizer == "hf"

    procs = {n: start(run, n, tmp_path / "logs") for n in ("trainer", "worker0")}
    codes = wait_all(procs, timeout=400)
    logs = {n: (tmp_path / "logs" / f"{n}.log").read_text()[-3000:] for n in procs}
    assert codes == {"trainer": 0, "worker0": 0}, logs

    # Every reward is math-verify's verdict (in the sandbox) on the decoded completion.
    from pipeline.tokenizer.run import run_tokenizer

    tok = run_tokenizer(Run.open(run.url))
    by_id = {p.problem_id: p for p in train}
    keys = [k for k in run.store.list("rollouts/") if k.endswith(".parquet")]
    assert keys
    for key in keys[:2]:
        batch = from_parquet_bytes(run.store.read(key))
        problems = [by_id[i] for i in batch.prompt_id]
        assert batch.completion == [tok.decode(ids) for ids in batch.completion_ids]
        want = get_task("math").verify_batch(problems, batch.completion)
        np.testing.assert_array_equal(np.asarray(batch.reward, dtype=float), want)

    launcher.stream(launcher.job_command("eval", run.url, ("--version", "all")), name="eval")
    evals = sorted(run.read_metrics("eval"), key=lambda r: r["version"])
    assert [r["version"] for r in evals][-1] == 2 and set(evals[-1]["per_task"]) == {"math"}
    for r in evals:
        m = r["metrics"]
        assert 0.0 <= m["pass@1"]["mean"] <= m["pass@4"]["mean"] <= 1.0, r
