"""Routing replay (issue 38, item 4): the samplers record the experts every token went to,
the rollout batch carries them, and the trainer replays them.

The recorded experts are checked against an independent forward: the cache-less training
forward's own routers (`Transformer.hidden_and_router`) on prompt + completion. Replay is
checked by what it changes: a trainer log-prob moves when the record is altered, does not
when nothing is recorded, and in float32 sampling equals the sampler's to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.batch_checks import read_checked
from pipeline.config import ModelConfig
from pipeline.errors import ConfigError
from pipeline.rollouts import RolloutBatch, to_parquet_bytes
from tests.runs import tiny_config
from tpu_jobs.generate.engine import Engine
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.learning.step import Learner
from tpu_jobs.model.state import flat_to_params
from tpu_jobs.model.transformer import flat_params, init_model, positions_from_mask

pytestmark = pytest.mark.moe  # the `moe` lane of .ci/run

CFG = ModelConfig(preset="tiny_moe", vocab_size=64, qk_norm=True, norm_topk_prob=True)
E, LAYERS, K = CFG.num_experts, CFG.num_layers, CFG.num_experts_per_tok
PROMPTS = [[1, 5, 9, 13, 4], [1, 7], [1, 20, 30, 40, 50, 60, 21], [1, 7]]


def _model(seed: int = 3):
    """A random tiny MoE whose routers are far from uniform (random init's router logits
    are tiny, so every top-k would be a near tie)."""
    model = init_model(CFG, seed)
    key = jax.random.key(seed + 100)
    for layer in model.layers:
        key, sub = jax.random.split(key)
        kernel = layer.mlp.gate.kernel
        kernel.set_value(jax.random.normal(sub, kernel[...].shape) * 0.5)
    return model


def _sample(model, sampler, prompts=PROMPTS, max_new=10):
    keys = jax.random.split(jax.random.key(5), len(prompts))
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    return sampler.generate(model, prompts, keys, params)


@pytest.fixture(scope="module")
def sampled():
    model = _model()
    static = _sample(model, StaticSampler(CFG, pad_id=0, eos_id=2))
    return model, static


def test_the_samplers_record_the_experts_the_training_forward_chooses(sampled):
    model, out = sampled
    assert out.routing is not None and len(out.routing) == len(PROMPTS)
    decided = 0
    for i, prompt in enumerate(PROMPTS):
        n = int(out.lengths[i])
        rec = out.routing[i]
        assert rec.dtype == np.uint8 and rec.shape == (len(prompt) + n, LAYERS, K)
        assert np.all(rec[-1] == E)  # the last token was never fed: not recorded
        tokens = jnp.asarray([prompt + out.tokens[i, :n].tolist()])
        ones = jnp.ones_like(tokens)
        _, router = model.hidden_and_router(tokens, positions_from_mask(ones), ones)
        probs = np.asarray(jax.nn.softmax(router.logits[:, 0, :-1], axis=-1))  # [L, T, E]
        ref = np.sort(np.asarray(router.experts[:, 0, :-1]), axis=-1)  # [L, T, k]
        got = np.sort(np.moveaxis(rec[:-1], 1, 0), axis=-1)
        # Where the k-th and (k+1)-th probabilities are apart by more than float32 rounding
        # of the two forwards, the choice is the same.
        top = -np.sort(-probs, axis=-1)
        clear = (top[..., K - 1] - top[..., K]) > 1e-4
        assert np.array_equal(got[clear], ref[clear])
        decided += clear.sum()
    assert decided > 0.9 * sum(len(r) - 1 for r in out.routing) * LAYERS


@pytest.mark.parametrize("kv_tokens", [None, 64], ids=["roomy", "preempting"])
def test_the_engine_records_what_the_static_sampler_records(sampled, kv_tokens):
    model, _ = sampled
    prompts = PROMPTS * 3  # 12 rows through 4 slots: refills, and preemptions in 64 tokens
    static = _sample(model, StaticSampler(CFG, pad_id=0, eos_id=2), prompts, 20)
    engine = Engine(CFG, pad_id=0, eos_id=2, max_slots=4, row_buckets=(4,), kv_tokens=kv_tokens,
                    page_size=4, chunk=4, prompt_buckets=(16,), check=True)  # fmt: skip
    out = _sample(model, engine, prompts, 20)
    assert (engine.stats["preemptions"] > 0) == (kv_tokens is not None)
    np.testing.assert_array_equal(out.tokens, static.tokens)
    for got, want in zip(out.routing, static.routing, strict=True):
        np.testing.assert_array_equal(got, want)


def _batch(out, routing=True) -> RolloutBatch:
    n = len(PROMPTS)
    completions = [out.tokens[i, : out.lengths[i]].tolist() for i in range(n)]
    return RolloutBatch(
        batch_index=0,
        prompt_pos=np.repeat(np.arange(n // 2), 2),
        prompt_id=[f"p{i // 2}" for i in range(n)],
        task=["arithmetic"] * n,
        sample_index=np.tile(np.arange(2), n // 2),
        prompt_ids=PROMPTS,
        completion_ids=completions,
        behaviour_logprobs=[out.logprobs[i, : out.lengths[i]].tolist() for i in range(n)],
        completion=["x"] * n,
        finished=out.finished,
        reward=np.asarray([1.0, 0.0, 0.0, 1.0], np.float32),
        policy_version=0,
        worker_id="w0",
        routing=[r.reshape(-1) for r in out.routing] if routing else None,
    )


def _learner(replay: bool) -> Learner:
    cfg = tiny_config(
        "model.preset=tiny_moe", "model.hidden_size=32", "model.intermediate_size=64",
        "model.vocab_size=64", "model.qk_norm=true",
        "model.norm_topk_prob=true", "rollout.prompts_per_batch=2", "rollout.group_size=2",
        "sampler.max_new_tokens=10", "trainer.kl_coef=0", f"trainer.routing_replay={replay}",
    )  # fmt: skip
    assert cfg.model == CFG
    return Learner(cfg, 8, fused=False)


def _params(learner: Learner, model):
    params, opt = learner.init_state(learner.new_policy(0))
    policy = flat_to_params(learner.fns, params["policy"], flat_params(model))
    return {**params, "policy": policy}, opt


def _logp(learner: Learner, params, batch: RolloutBatch):
    inp = learner.inputs(batch)
    logp = learner.programs.forward(params, inp.tokens, inp.mask, None, None, None, inp.routing)
    return np.asarray(logp[0]), inp


def test_replay_uses_the_record_and_routes_where_nothing_was_recorded(sampled):
    model, out = sampled
    batch = _batch(out)
    on, off = _learner(True), _learner(False)
    params, _ = _params(on, model)
    logp_off, inp = _logp(off, params, batch)
    assert inp.routing is None
    logp_on, inp = _logp(on, params, batch)
    real = inp.comp_mask > 0
    # The record is what the trainer's routers choose in float32 (up to near ties): the
    # same log-probs, which are the sampler's to float32 rounding.
    np.testing.assert_allclose(logp_on[real], logp_off[real], atol=1e-5)
    np.testing.assert_allclose(logp_on[real], inp.logp_behaviour[real], atol=1e-5)
    # A row without a record routes itself: bit-identical to replay off.
    unrecorded, _ = _logp(on, params, _batch(out, routing=False))
    np.testing.assert_array_equal(unrecorded[real], logp_off[real])
    # Another record (every prompt token of every layer sent to the next experts, mod E):
    # the completion's log-probs change, so the trainer ran those experts.
    moved = _batch(out)
    moved.routing = []
    for prompt, r in zip(PROMPTS, out.routing, strict=True):
        r = r.copy()
        r[: len(prompt)] = (r[: len(prompt)] + 1) % E
        moved.routing.append(r.reshape(-1))
    logp_moved, _ = _logp(on, params, moved)
    assert np.abs(logp_moved[real] - logp_on[real]).max() > 1e-3


def test_with_replay_and_float32_sampling_the_ratios_are_one_and_the_router_learns(sampled):
    model, out = sampled
    learner = _learner(True)
    params, opt = _params(learner, model)
    gate = [np.asarray(layer.mlp.gate.kernel[...]) for layer in model.layers]
    new, _, m = learner.step(params, opt, None, learner.inputs(_batch(out)))
    # pi_theta / pi_old is 1 by construction (recomputed pi_old); pi_old / pi_behaviour is
    # 1 to float32 rounding: the trainer runs the sampler's experts.
    assert m["ratio_max"] == m["ratio_min"] == 1.0
    assert 1 - 1e-5 < m["is_ratio_min"] <= m["is_ratio_max"] < 1 + 1e-5
    assert m["logprob_absdiff_max"] < 1e-5
    names = flat_params(learner.fns.merge(new["policy"]))
    for i, before in enumerate(gate):  # the routers get a gradient through the weights
        assert np.abs(names[f"layers.{i}.mlp.gate.kernel"] - before).max() > 0


def test_the_rollout_worker_writes_the_routing_the_trainer_checks_and_replays(tmp_path):
    from pipeline.problem_sets import write_data
    from pipeline.run import Run, base_server
    from tpu_jobs.rollout_worker import RolloutWorker
    from tpu_jobs.trainer import Trainer, TrainerState

    cfg = tiny_config(
        "model.preset=tiny_moe", "rollout.prompts_per_batch=2", "rollout.group_size=2",
        "sampler.max_new_tokens=8", "task.num_train=20", "task.num_eval=4",
        "trainer.routing_replay=true",
    )  # fmt: skip
    run = Run.create(str(tmp_path / "run"), cfg)
    write_data(run)
    base = base_server(run)
    flat = flat_params(init_model(cfg.model, 0))
    base.publish(0, flat, epoch=base.acquire_epoch())
    worker = RolloutWorker(run, "w0", log=lambda m: None)
    batch = worker.generate_batch(0, 0)
    trainer = Trainer(run, log=lambda m: None, fused=False)
    state = TrainerState(params=None, opt_state=None)  # batch 0's limits
    checked = read_checked(to_parquet_bytes(batch), trainer._limits(state))
    for row, (prompt, completion) in enumerate(
        zip(batch.prompt_ids, batch.completion_ids, strict=True)
    ):
        rec = checked.routing[row].reshape(-1, cfg.model.num_layers, 2)
        assert rec.dtype == np.uint8 and len(rec) == len(prompt) + len(completion)
        assert np.all(rec[:-1] < 4) and np.all(rec[-1] == 4)
    inp = trainer.learner.inputs(checked)
    assert inp.routing.shape == (*inp.tokens.shape, cfg.model.num_layers, 2)


def test_configurations_replay_refuses():
    with pytest.raises(ConfigError, match="trainer.routing_replay.*false for a dense model"):
        tiny_config("trainer.routing_replay=true")
    with pytest.raises(ConfigError, match="trainer.routing_replay.*trainer.pack"):
        tiny_config("model.preset=tiny_moe", "trainer.routing_replay=true", "trainer.pack=true")


def _expert_kernels(learner: Learner, params, expert: int) -> dict[str, np.ndarray]:
    flat = flat_params(learner.fns.merge(params["policy"]))
    return {n: np.array(v[expert]) for n, v in flat.items() if ".mlp.experts." in n}


def test_an_expert_no_token_reached_keeps_its_weights_unless_adam_remembers_it(sampled):
    """What bounds a MoE run's delta versions: replaying a record that sends no token to
    expert E-1 (every token sent to two of the others) gives that expert a zero gradient.
    From fresh AdamW moments (weight decay 0) its weights stay bit-identical; after a
    step in which it got tokens, the moments still move it."""
    model, out = sampled
    learner = _learner(True)
    avoid = _batch(out)
    avoid.routing = []
    for r in out.routing:
        first = r[:, :, :1] % (E - 1)  # two different experts of 0..E-2 per token and layer
        r = np.concatenate([first, (first + 1) % (E - 1)], axis=-1).astype(r.dtype)
        r[-1] = E  # the last token still unrecorded
        avoid.routing.append(r.reshape(-1))
    params, opt = _params(learner, model)
    before = _expert_kernels(learner, params, E - 1)
    used = _expert_kernels(learner, params, 0)
    params1, _, _ = learner.step(params, opt, None, learner.inputs(avoid))
    for name, value in _expert_kernels(learner, params1, E - 1).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    assert all(
        np.abs(v - used[n]).max() > 0 for n, v in _expert_kernels(learner, params1, 0).items()
    )
    # A step with its own routing (expert E-1 reached), then the avoiding batch again
    # (fresh params: a step donates the ones it is given).
    params, opt = _params(learner, model)
    params2, opt2, _ = learner.step(params, opt, None, learner.inputs(_batch(out)))
    held = _expert_kernels(learner, params2, E - 1)
    params3, _, _ = learner.step(params2, opt2, None, learner.inputs(avoid))
    moved = _expert_kernels(learner, params3, E - 1)
    assert all(np.abs(moved[n] - held[n]).max() > 0 for n in held)
