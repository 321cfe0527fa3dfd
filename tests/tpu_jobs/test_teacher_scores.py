"""tpu_jobs.generate.teacher: the pinned teacher's log-probs of rollout tokens against
`transformers` (the teacher exported to an HF checkpoint, scored by torch at the sampler's
temperature), row by row independent of the batch and its padding bucket, 0 off the loss
mask, with a teacher of another shape than the student."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.run import Run, weights_server  # noqa: E402
from tests.runs import tiny_config  # noqa: E402
from tpu_jobs.generate.teacher import TeacherScorer  # noqa: E402
from tpu_jobs.model import hf_checkpoint  # noqa: E402
from tpu_jobs.model.transformer import flat_params, init_model  # noqa: E402

pytestmark = pytest.mark.distill

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
torch.set_num_threads(1)

TEMPERATURE = 0.7
TEACHER_HIDDEN, STUDENT_HIDDEN = 64, 32
TOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the student's TeacherScorer, the teacher as a transformers model, vocab size)."""
    root = tmp_path_factory.mktemp("teacher-scores")
    teacher = Run.create(str(root / "teacher"), tiny_config(f"model.hidden_size={TEACHER_HIDDEN}"))
    cfg = teacher.config.model
    rng = np.random.default_rng(0)
    # Larger than init weights, so the teacher's distributions are far from uniform.
    flat = {
        k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
        for k, v in flat_params(init_model(cfg, 3)).items()
    }
    server = weights_server(teacher)
    server.publish(1, flat, epoch=server.acquire_epoch())
    student = Run.create(
        str(root / "student"),
        tiny_config(
            f"model.hidden_size={STUDENT_HIDDEN}",
            "trainer.algorithm=opd",
            f"distill.teacher={teacher.url}",
            f"sampler.temperature={TEMPERATURE}",
        ),
    )
    scorer = TeacherScorer(student, log=lambda line: None)
    hf_dir = hf_checkpoint.export_hf(Path(root / "hf"), cfg, flat)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager"
    ).eval()
    assert hf_model.dtype == torch.float32
    return scorer, hf_model, cfg.vocab_size


def torch_scores(
    hf_model, prompt, completion, loss_mask=None, temperature=TEMPERATURE
) -> np.ndarray:
    """log softmax(logits / T) of each completion token given everything before it, one
    unpadded row at a time; 0 where the loss mask is 0."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1).numpy()
    p = len(prompt)
    out = np.array([logp[p + t - 1, tok] for t, tok in enumerate(completion)])
    return out if loss_mask is None else np.where(np.asarray(loss_mask) > 0, out, 0.0)


def rows(vocab: int, n: int, seed: int, long_prompt: bool = False):
    rng = np.random.default_rng(seed)
    prompts, completions = [], []
    for _ in range(n):
        p = int(rng.integers(3, 24 if long_prompt else 12))
        c = int(rng.integers(1, 20))
        prompts.append([1, *rng.integers(3, vocab, p).tolist()])  # BOS + text
        completions.append([*rng.integers(3, vocab, c - 1).tolist(), 2])  # ... EOS
    return prompts, completions


def test_the_scorer_loads_the_teacher_with_its_own_shape(setup):
    scorer, hf_model, _ = setup
    assert scorer.model_cfg.hidden_size == TEACHER_HIDDEN != STUDENT_HIDDEN
    assert hf_model.config.hidden_size == TEACHER_HIDDEN
    assert scorer.temperature == TEMPERATURE
    assert scorer.pin.version == 1


def test_teacher_log_probs_match_transformers_at_the_sampler_temperature(setup):
    scorer, hf_model, vocab = setup
    prompts, completions = rows(vocab, 5, seed=1)
    # Rows 1 and 3 have loss masks with holes (a tool observation), the others none.
    masks = [None] * 5
    masks[1] = [1 if t % 3 else 0 for t in range(len(completions[1]))]
    masks[3] = [0] * 2 + [1] * (len(completions[3]) - 2)
    got = scorer.score(prompts, completions, masks)
    assert [len(g) for g in got] == [len(c) for c in completions]
    worst = 0.0
    for i in range(5):
        ref = torch_scores(hf_model, prompts[i], completions[i], masks[i])
        worst = max(worst, float(np.abs(np.asarray(got[i]) - ref).max()))
        if masks[i] is not None:
            off = np.asarray(masks[i]) == 0
            assert off.any() and np.all(np.asarray(got[i])[off] == 0.0)
        assert np.all(np.asarray(got[i])[ref != 0] < 0)
    assert worst <= TOL, worst
    # at temperature 1 the numbers differ: the temperature is applied
    at_one = torch_scores(hf_model, prompts[0], completions[0], temperature=1.0)
    assert np.abs(at_one - np.asarray(got[0])).max() > 1e-3


def test_a_rows_scores_do_not_depend_on_the_batch_or_its_padding_bucket(setup):
    scorer, _, vocab = setup
    prompts, completions = rows(vocab, 3, seed=2)
    alone = [scorer.score([prompts[i]], [completions[i]])[0] for i in range(3)]
    together = scorer.score(prompts, completions)
    # More rows (batch bucket 16), a longer prompt (prompt bucket 32) and a longer
    # completion (completion bucket 32) around the same three rows.
    more_p, more_c = rows(vocab, 9, seed=3, long_prompt=True)
    more_c[0] = more_c[0] * 3
    wide = scorer.score([*more_p, *prompts], [*more_c, *completions])[9:]
    assert max(len(p) for p in more_p) > 16 and max(len(c) for c in more_c) > 16
    for i in range(3):
        for other in (together[i], wide[i]):
            # The same numbers up to float32 rounding (other shapes sum in another order):
            # a few ulps, far below the 1e-5 against transformers and any row mix-up.
            np.testing.assert_allclose(other, alone[i], rtol=32 * np.finfo(np.float32).eps)
    assert scorer.score([], []) == []
