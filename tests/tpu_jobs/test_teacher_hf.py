"""An HF checkpoint imported with `rlax import-hf` as the teacher of on-policy distillation:
two tiny random HF checkpoints built offline with one tokenizer.json (a Qwen3 teacher of
hidden size 64, a Llama student of 32), each imported into its run by the CLI; the student
run pins the teacher's base with the imported tokenizer's identity, its TeacherScorer and
its rollout worker's batch give torch's log_softmax of the teacher's logits at the
student's temperature, and a teacher imported with another tokenizer.json is refused.
Imports, pins and samples: `distill` lane."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.paramserver import ParamServer  # noqa: E402
from pipeline.paramserver.adapters import base_digest  # noqa: E402
from pipeline.run import Run, base_server  # noqa: E402
from pipeline.teacher import (  # noqa: E402
    PIN_KEY,
    TEACHER_PREFIX,
    TeacherError,
    pin_teacher,
    teacher_config,
)
from tests.tpu_jobs.test_hf import build_hf, make_char_level_tokenizer_dir  # noqa: E402
from tests.tpu_jobs.test_teacher_scores import rows, torch_scores  # noqa: E402
from tpu_jobs import hf  # noqa: E402
from tpu_jobs.generate.teacher import TeacherScorer  # noqa: E402

pytestmark = pytest.mark.distill

RLAX = str(Path(sys.executable).parent / "rlax")
TEMPERATURE = 0.7
TEACHER_HIDDEN, STUDENT_HIDDEN = 64, 32
TOL = 1e-5
SMALL = (  # a small run: few problems, one short batch
    "task.num_train=32",
    "task.num_eval=4",
    "rollout.prompts_per_batch=2",
    "rollout.group_size=2",
    "sampler.max_new_tokens=16",
)


def save_checkpoint(model, tok_dir: Path, path: Path) -> Path:
    """`model` saved at `path` with the tokenizer files of `tok_dir` beside it."""
    model.save_pretrained(path)
    for f in tok_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    return path


def student_overrides(teacher_url: str) -> list[str]:
    return [
        *SMALL,
        "trainer.algorithm=opd",
        f"distill.teacher={teacher_url}",
        "distill.teacher_version=base",
        f"sampler.temperature={TEMPERATURE}",
        "model.tokenizer=hf",
    ]


def rlax_import(path: Path, run_url: str, overrides: list[str]) -> None:
    done = subprocess.run(
        [RLAX, "import-hf", str(path), "--run", run_url, *overrides],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> SimpleNamespace:
    """The teacher run T and the student run S, both made by `rlax import-hf`."""
    root = tmp_path_factory.mktemp("teacher-hf")
    tok_dir, vocab = make_char_level_tokenizer_dir(root / "tok")
    im_end = vocab - 1
    teacher_hf = build_hf(
        "qwen3",
        seed=1,
        vocab_size=vocab,
        eos_token_id=im_end,
        hidden_size=TEACHER_HIDDEN,
        intermediate_size=2 * TEACHER_HIDDEN,
    )
    student_hf = build_hf("llama", seed=2, vocab_size=vocab, eos_token_id=im_end)
    teacher_dir = save_checkpoint(teacher_hf, tok_dir, root / "teacher-ckpt")
    student_dir = save_checkpoint(student_hf, tok_dir, root / "student-ckpt")
    teacher_url, student_url = str(root / "T"), str(root / "S")
    rlax_import(teacher_dir, teacher_url, list(SMALL))
    rlax_import(student_dir, student_url, student_overrides(teacher_url))
    return SimpleNamespace(
        root=root,
        tok_dir=tok_dir,
        vocab=vocab,
        teacher_hf=teacher_hf,
        teacher_dir=teacher_dir,
        student_dir=student_dir,
        teacher=Run.open(teacher_url),
        student=Run.open(student_url),
    )


def test_the_student_pins_the_imported_teachers_base_with_its_tokenizer(imported):
    teacher, student = imported.teacher, imported.student
    assert student.config.model.hidden_size == STUDENT_HIDDEN
    assert student.config.model.tokenizer == teacher.config.model.tokenizer == "hf"
    pin = pin_teacher(student)
    assert (pin.run, pin.version) == (teacher.url, "base")
    assert pin.digest == base_digest(base_server(teacher).manifest(0))
    record = json.loads(student.store.read(PIN_KEY))
    sha = hashlib.sha256((imported.tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert record["tokenizer"] == {"name": "hf", "sha256": sha}
    assert record["requested"] == "base"
    # The teacher's shape is its own import's: a Qwen3 (qk norm, head_dim 16) of hidden 64.
    model = teacher_config(student).model
    assert model == teacher.config.model
    assert (model.hidden_size, model.qk_norm, model.head_dim) == (TEACHER_HIDDEN, True, 16)
    assert pin_teacher(student) == pin  # pinned once


def test_the_scorer_gives_the_hf_teachers_log_probs(imported):
    scorer = TeacherScorer(imported.student, log=lambda line: None)
    assert scorer.model_cfg.hidden_size == TEACHER_HIDDEN and scorer.temperature == TEMPERATURE
    prompts, completions = rows(imported.vocab, 5, seed=1)
    masks = [None] * 5
    masks[2] = [1 if t % 3 else 0 for t in range(len(completions[2]))]  # a mask with holes
    got = scorer.score(prompts, completions, masks)
    worst = 0.0
    for i in range(5):
        ref = torch_scores(imported.teacher_hf, prompts[i], completions[i], masks[i], TEMPERATURE)
        worst = max(worst, float(np.abs(np.asarray(got[i]) - ref).max()))
    assert worst <= TOL, worst
    assert np.all(np.asarray(got[2])[np.asarray(masks[2]) == 0] == 0.0)


def test_the_rollout_worker_writes_the_hf_teachers_log_probs(imported):
    from tpu_jobs.rollout_worker import RolloutWorker

    student = imported.student
    ps = ParamServer(student.store)  # v0 for the worker (the trainer's first publish)
    ps.publish(0, base_server(student).pull(0).tensors, epoch=ps.acquire_epoch())
    worker = RolloutWorker(student, "w0", log=lambda line: None)
    assert worker._ensure_version(0)
    batch = worker.generate_batch(0, 0)
    assert batch.teacher_logprobs is not None and len(batch) == 4
    assert sum(map(len, batch.completion_ids)) > 8
    for i in range(len(batch)):
        ref = torch_scores(
            imported.teacher_hf,
            batch.prompt_ids[i],
            batch.completion_ids[i],
            temperature=TEMPERATURE,
        )
        np.testing.assert_allclose(batch.teacher_logprobs[i], ref, rtol=0, atol=TOL)


def test_a_teacher_with_another_tokenizer_json_is_refused(imported):
    from tokenizers import Tokenizer

    root = imported.root
    other_tok = root / "tok-extra"
    other_tok.mkdir()
    for f in imported.tok_dir.iterdir():
        (other_tok / f.name).write_bytes(f.read_bytes())
    tok = Tokenizer.from_file(str(other_tok / "tokenizer.json"))
    assert tok.add_tokens(["<extra>"]) == 1  # one token more, the rest the same
    tok.save(str(other_tok / "tokenizer.json"))
    other = build_hf(
        "qwen3", seed=3, vocab_size=imported.vocab + 1, eos_token_id=imported.vocab - 1
    )
    other_dir = save_checkpoint(other, other_tok, root / "other-ckpt")
    other_url = str(root / "T2")
    hf.import_to_run(other_dir, other_url, overrides=list(SMALL), log=lambda line: None)
    student_url = str(root / "S2")
    hf.import_to_run(
        imported.student_dir,
        student_url,
        overrides=student_overrides(other_url),
        log=lambda line: None,
    )
    student = Run.open(student_url)
    mine = hashlib.sha256((imported.tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    theirs = hashlib.sha256((other_tok / "tokenizer.json").read_bytes()).hexdigest()
    assert mine != theirs
    with pytest.raises(TeacherError) as err:
        pin_teacher(student)
    message = str(err.value)
    assert "\n" not in message
    assert other_url in message and mine in message and theirs in message, message
    assert f"{other_url}/base/hf/tokenizer.json, sha256 {theirs}" in message, message
    # Refused before anything was copied or claimed.
    assert not student.store.list(TEACHER_PREFIX + "/")
