"""The sampling interface (tpu_jobs/generate/interface.py): each role's SamplingParams from
the run config, the evaluator's stated policy (its own temperature, no top-k / top-p),
the Sampler protocol of every sampler, and one policy loader for the three sampling jobs.

The jobs are run for real on a tiny run with non-default top_k / top_p, on the real
static sampler; the sampler each job gets is wrapped to record the SamplingParams of every
call, so the test sees what reached the sampler, not what a job meant to pass."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
import pytest

from pipeline.paramserver import ParamServer
from pipeline.problem_sets import write_data
from pipeline.run import Run
from tests.runs import tiny_config
from tpu_jobs import pass_rates as pr
from tpu_jobs.evaluator import Evaluator
from tpu_jobs.generate import policy, registry
from tpu_jobs.generate.engine import Engine, Request
from tpu_jobs.generate.interface import (
    ROLES,
    Sampler,
    SampleResult,
    SamplingParams,
    sampling_params,
)
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.generate.vllm_sampler import VllmSampler
from tpu_jobs.model.judge import VERDICT_MAX_TOKENS
from tpu_jobs.model.transformer import flat_params, init_model
from tpu_jobs.rollout_worker import RolloutWorker

# Non-default settings everywhere, so a setting that does not arrive shows.
OVERRIDES = (
    "sampler.engine=static",
    "sampler.max_new_tokens=8",
    "sampler.temperature=0.7",
    "sampler.top_k=5",
    "sampler.top_p=0.9",
    "sampler.dtype=bfloat16",
    "eval.temperature=0.3",
    "eval.num_problems=2",
    "eval.num_samples=2",
    "eval.ks=[1]",
    "eval.bootstrap=10",
    "eval.self_prm=false",
    "rollout.judge_fraction=0.5",
    "task.num_train=16",
    "task.num_eval=4",
)
# What each role must sample with under OVERRIDES, written out by hand.
ROLLOUT = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9, dtype="bfloat16")
EXPECTED = {
    "rollout": ROLLOUT,
    "judge": SamplingParams(VERDICT_MAX_TOKENS, 0.7, 5, 0.9, "bfloat16"),
    "pass_rates": ROLLOUT,
    # The evaluator's policy: eval.temperature, top-k and top-p off.
    "eval": SamplingParams(max_new_tokens=8, temperature=0.3, top_k=0, top_p=1.0, dtype="bfloat16"),
}


def test_each_role_gets_its_settings_from_the_config():
    cfg = tiny_config(*OVERRIDES)
    assert set(ROLES) == set(EXPECTED)
    for role, expected in EXPECTED.items():
        assert sampling_params(cfg, role) == expected, role
    with pytest.raises(ValueError, match=r"role='trainer' is invalid; allowed: 'rollout'"):
        sampling_params(cfg, "trainer")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(max_new_tokens=0), r"max_new_tokens=0 is invalid; allowed: > 0"),
        (dict(temperature=-1.0), r"temperature=-1.0 is invalid; allowed: >= 0"),
        (dict(top_k=-2), r"top_k=-2 is invalid; allowed: >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 is invalid; allowed: \(0, 1\]"),
        (dict(dtype="float16"), r"dtype='float16' is invalid; allowed: float32, bfloat16"),
    ],
)
def test_bad_sampling_params_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{"max_new_tokens": 4, **change})


def test_every_sampler_implements_the_protocol():
    cfg = tiny_config()
    assert isinstance(StaticSampler(cfg.model), Sampler)
    assert isinstance(Engine(cfg.model, max_slots=4), Sampler)
    # VllmSampler needs a vLLM virtualenv to run; its interface is checked by signature.
    want = inspect.signature(Sampler.generate)
    for cls in (StaticSampler, Engine, VllmSampler):
        got = inspect.signature(cls.generate)
        assert list(got.parameters) == list(want.parameters), cls.__name__
        assert got.parameters["params"].annotation in ("SamplingParams", SamplingParams)


class Recording:
    """The run's real sampler, recording the SamplingParams of every call."""

    def __init__(self, inner: Sampler) -> None:
        self.inner, self.pad_id, self.eos_id = inner, inner.pad_id, inner.eos_id
        self.calls: list[SamplingParams] = []

    def generate(self, model, prompts, keys, params: SamplingParams) -> SampleResult:
        self.calls.append(params)
        return self.inner.generate(model, prompts, keys, params)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    run = Run.create(str(tmp_path_factory.mktemp("sampling") / "run"), tiny_config(*OVERRIDES))
    write_data(run)
    ps = ParamServer(run.store)
    ps.publish(0, flat_params(init_model(run.config.model, 1)), epoch=ps.acquire_epoch())
    return run


@pytest.fixture
def recorded(monkeypatch) -> list[Recording]:
    """The samplers load_policy builds from now on, each recording its calls."""
    made: list[Recording] = []

    def make(cfg, tok, mesh):
        made.append(Recording(registry.make_sampler(cfg, tok, mesh)))
        return made[-1]

    monkeypatch.setattr(policy, "make_sampler", make)
    return made


def test_top_k_and_top_p_reach_every_role_but_the_evaluator(run, recorded):
    worker = RolloutWorker(run, "w0", log=lambda m: None)
    assert worker._ensure_version(0) and worker.policy.version == 0
    batch = worker.generate_batch(0, 0)
    assert set(batch.kind) == {"solve", "judge"}
    assert recorded[0].calls == [EXPECTED["rollout"], EXPECTED["judge"]]

    evaluator = Evaluator(run, log=lambda m: None)
    evaluator.evaluate(0)
    assert recorded[1].calls and set(recorded[1].calls) == {EXPECTED["eval"]}

    problems = run.read_problems("train")[:2]
    pr.pass_rates(run, problems, 2, 0, log=lambda *_: None)
    assert recorded[2].calls == [EXPECTED["pass_rates"]]
    pr.pass_rates(run, problems, 2, 0, temperature=1.5, log=lambda *_: None)  # --temperature
    assert recorded[3].calls == [SamplingParams(8, 1.5, 5, 0.9, "bfloat16")]


def test_load_policy_loads_the_version_and_refuses_unknown_roles(run):
    snap = ParamServer(run.store).pull(0)
    loaded = policy.load_policy(run, "pass_rates", snapshot=snap)
    assert loaded.version == 0 and isinstance(loaded.sampler, StaticSampler)
    for name, value in flat_params(loaded.model).items():
        assert jax.numpy.array_equal(value, snap.tensors[name]), name
    with pytest.raises(ValueError, match=r"role='judge' is invalid; allowed: 'rollout', 'eval'"):
        policy.load_policy(run, "judge")


def test_load_policy_takes_another_model_shape(run, recorded):
    # A pinned teacher of another shape than the run's model (on-policy distillation):
    # the model and the sampler are both built from the shape given.
    shape = dataclasses.replace(run.config.model, hidden_size=32)
    loaded = policy.load_policy(run, "eval", model=shape)
    want = {k: v.shape for k, v in flat_params(init_model(shape, 0)).items()}
    assert {k: v.shape for k, v in flat_params(loaded.model).items()} == want
    assert want != {k: v.shape for k, v in flat_params(init_model(run.config.model, 0)).items()}
    assert recorded[0].inner.cfg == shape


def test_the_engine_refuses_a_request_longer_than_its_params():
    cfg = tiny_config()
    eng, model = Engine(cfg.model, max_slots=4), init_model(cfg.model, 0)
    key = np.zeros(2, np.uint32)
    requests = [Request([1, 2], key, 4), Request([1, 2], key, 9)]
    with pytest.raises(ValueError, match=r"request 1: max_new_tokens=9 is invalid; allowed: <= "):
        eng.run(model, requests, SamplingParams(max_new_tokens=8))
