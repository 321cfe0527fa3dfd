"""Tool episodes (tpu_jobs.generate.episodes) on a tiny model that has memorised one episode:
three Python calls (one raises, one hangs, one prints the sum) and the final answer, run
through the real engine and the real sandbox.

The expected episode, its loss mask and its observations are written out by hand below;
the model only has to reproduce its own turns (it learns them to a loss of ~1e-3 in ~1 s),
so every turn boundary, observation and mask entry is checked against text, not against
what the code under test produced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pipeline.batch_checks import BatchLimits, read_checked
from pipeline.config import EnvironmentConfig, ModelConfig
from pipeline.environments import make_environment
from pipeline.rollouts import RolloutBatch, to_parquet_bytes
from pipeline.sandbox.isolation import userns_forbidden
from pipeline.tasks import TASKS
from pipeline.tokenizer import get_tokenizer
from pipeline.tool_calls import CALL_CLOSE, CALL_OPEN, OUTPUT_CLOSE, OUTPUT_OPEN
from tpu_jobs.generate.engine import Engine, Request
from tpu_jobs.generate.episodes import run_episodes, sample_episodes_and_verify
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.model.transformer import init_model

_FORBIDDEN = userns_forbidden()
pytestmark = pytest.mark.skipif(_FORBIDDEN is not None, reason=f"no sandbox here: {_FORBIDDEN}")

TOK = get_tokenizer("char")
CFG = ModelConfig(preset="tiny", hidden_size=64, intermediate_size=192)
ENV = EnvironmentConfig(
    name="python", max_turns=4, max_episode_tokens=200, observation_chars=48, timeout_s=0.25
)
PROBLEM = TASKS["arithmetic"].make("+", 17, 23)
TURNS = [
    CALL_OPEN + "print(1/0)\n" + CALL_CLOSE,
    CALL_OPEN + "while 1:pass\n" + CALL_CLOSE,
    CALL_OPEN + "print(17+23)\n" + CALL_CLOSE,
    "#40",
]
# The recorded observations, by hand: the traceback cut to 48 characters (44 + "...\n"),
# the timeout message, the program's output.
OBSERVATIONS = [
    OUTPUT_OPEN + 'Traceback (most recent call last):\n  File "<...\n' + OUTPUT_CLOSE,
    OUTPUT_OPEN + "timeout after 0.25 s\n" + OUTPUT_CLOSE,
    OUTPUT_OPEN + "40\n" + OUTPUT_CLOSE,
]
PIECES = [TURNS[0], OBSERVATIONS[0], TURNS[1], OBSERVATIONS[1], TURNS[2], OBSERVATIONS[2]]
PIECES.append(TURNS[3])
# Sampled pieces (turns, the last with its EOS) have mask 1, observations 0.
MASK = [m for i, p in enumerate(PIECES) for m in [1 - i % 2] * len(p)] + [1]


@pytest.fixture(scope="module")
def model():
    """The tiny model after memorising prompt + PIECES + EOS (Adam, full-batch)."""
    ids = TOK.encode_prompt(PROBLEM.prompt) + TOK.encode("".join(PIECES)) + [TOK.eos_id]
    tokens = jnp.asarray([ids + [TOK.pad_id] * (256 - len(ids))], jnp.int32)
    mask = (jnp.arange(256) < len(ids)).astype(jnp.int32)[None]
    model = init_model(CFG, 0)
    graphdef, params = nnx.split(model)
    tx = optax.adam(1e-2)

    def loss(params):
        positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
        logits = nnx.merge(graphdef, params)(tokens, positions, mask)[0]
        logp = jax.nn.log_softmax(logits[0, : len(ids) - 1])
        return -logp[jnp.arange(len(ids) - 1), tokens[0, 1 : len(ids)]].mean()

    @jax.jit
    def step(params, opt):
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    opt = tx.init(params)
    for _ in range(150):
        params, opt, value = step(params, opt)
    # Memorised: every completion token (turns and observations) has probability > 0.98,
    # so it is the argmax by a margin of log(0.98 / 0.02) ~ 3.9 nats, which no float
    # rounding (~1e-6 on these logits) can close: greedy decoding reproduces the episode on
    # any CPU. This is training without sampling on one fixed sequence, so rounding moves
    # the result a little (the least p was 0.993-0.995 under four ISA caps), not across 0.98.
    positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
    logits = nnx.merge(graphdef, params)(tokens, positions, mask)[0][0, : len(ids) - 1]
    p_next = jax.nn.softmax(logits)[jnp.arange(len(ids) - 1), tokens[0, 1 : len(ids)]]
    first = len(TOK.encode_prompt(PROBLEM.prompt)) - 1  # the completion's first prediction
    assert float(p_next[first:].min()) > 0.98, float(p_next[first:].min())
    nnx.update(model, params)
    return model


@pytest.fixture(scope="module")
def engine():
    """Few shapes to compile: one row bucket, one page per row (so one block-table width
    per program), prefills of 32 (prompts) or 256 tokens (observations, histories)."""
    return Engine(
        CFG,
        max_slots=4,
        row_buckets=(4,),
        prompt_buckets=(32, 256),
        page_size=256,
        detokenize=TOK.decode,
        check=True,
    )


def keys(n: int, seed: int = 3) -> jax.Array:
    return jax.random.split(jax.random.key(seed), n)


def test_an_episode_with_tool_calls_round_trips_through_the_rollout_format(model, engine):
    env = make_environment(ENV)
    scored = sample_episodes_and_verify(
        engine,
        model,
        TOK,
        env,
        ENV,
        [PROBLEM] * 2,
        keys(2),
        SamplingParams(max_new_tokens=40, temperature=0.0),
    )
    expected_ids = TOK.encode("".join(PIECES)) + [TOK.eos_id]
    for r in range(2):
        assert scored.texts[r] == "".join(PIECES)
        assert scored.completion_ids[r] == expected_ids
        assert scored.loss_masks[r] == MASK
        logp = np.asarray(scored.logprobs[r])
        assert (logp[np.asarray(MASK) == 0] == 0).all() and (logp < 0).all() == False  # noqa: E712
        assert (logp[np.asarray(MASK) == 1] <= 0).all()
    assert scored.turns == [4, 4] and scored.tool_calls == [3, 3]
    assert scored.tool_errors == [["error", "timeout"]] * 2
    assert scored.rewards.tolist() == [1.0, 1.0] and scored.finished.all()
    assert scored.tool_s >= 0.25 and scored.generate_s > 0  # the hang ran to its timeout
    assert 0 <= scored.tool_wait_s <= scored.tool_s
    assert engine.pool.in_use == 0  # every parked request released

    batch = RolloutBatch(
        batch_index=0,
        prompt_pos=np.zeros(2),
        prompt_id=[PROBLEM.problem_id] * 2,
        task=[PROBLEM.task] * 2,
        sample_index=np.arange(2),
        prompt_ids=scored.prompt_ids,
        completion_ids=scored.completion_ids,
        behaviour_logprobs=scored.logprobs,
        completion=scored.texts,
        finished=scored.finished,
        reward=scored.rewards,
        policy_version=0,
        worker_id="w",
        loss_mask=scored.loss_masks,
        turns=scored.turns,
        tool_calls=scored.tool_calls,
        tool_errors=scored.tool_errors,
    )
    limits = BatchLimits(0, 2, 2, CFG.vocab_size, 16, ENV.max_episode_tokens, 0, (0, 1), False)
    back = read_checked(to_parquet_bytes(batch), limits)
    assert [back.token_mask(r) for r in range(2)] == [MASK, MASK]
    assert back.turns == [4, 4] and back.tool_errors == [["error", "timeout"]] * 2
    assert back.completion_ids == [expected_ids] * 2


def _turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled tokens."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_a_resumed_turn_equals_a_fresh_prefill_of_the_whole_history(model, engine):
    """At temperature 1 (sampled, not memorised, tokens), every later turn of an episode
    equals a fresh request whose prompt is the whole history before it (tokens and
    log-probs): resuming from the parked cache changes nothing.

    Why it holds on any CPU: the comparison is between two computations on one machine;
    that later turns exist to compare is an outcome of sampling, made near-certain by the
    memorised episode (each of its tokens has p > 0.98, measured >= 0.993, so a row leaves
    it in the ~30 sampled tokens before its second call with probability < 0.19 as
    measured) and four rows (all four leave it with < 1.5e-3)."""
    env = make_environment(ENV)
    prompt = TOK.encode_prompt(PROBLEM.prompt)
    ks = keys(4, seed=11)
    episodes, _ = run_episodes(
        engine,
        model,
        env,
        TOK,
        [prompt] * 4,
        ks,
        ENV,
        SamplingParams(max_new_tokens=40, temperature=1.0),
    )
    fresh, expected = [], []
    for r, ep in enumerate(episodes):
        spans = _turn_spans(ep.loss_mask)
        assert len(spans) == ep.turns
        for start, end in spans[1:]:
            history = prompt + ep.completion_ids[:start]
            limit = min(40, ENV.max_episode_tokens - start)
            first = sum(ep.loss_mask[:start])  # the turn's first sample index
            stops = env.stop_strings
            fresh.append(Request(history, ks[r], limit, stop_strings=stops, first_step=first))
            expected.append((ep.completion_ids[start:end], ep.logprobs[start:end]))
    out = engine.run(model, fresh)  # one call: one prefill program (temperature 1: the default)
    for got, (tokens, logprobs) in zip(out, expected, strict=True):
        assert got.tokens == tokens
        np.testing.assert_allclose(got.logprobs, logprobs, atol=1e-5)
    checked = len(fresh)
    assert checked >= 2  # the test is not empty: some episode went on after a tool call


def test_the_loop_refuses_the_static_sampler(model):
    from tpu_jobs.generate.static_sampler import StaticSampler

    with pytest.raises(ValueError, match="sampler.engine='jax'"):
        run_episodes(StaticSampler(CFG), model, make_environment(ENV), TOK, [[1, 5]], keys(1), ENV, SamplingParams(max_new_tokens=4, temperature=1.0))  # fmt: skip


WORKER_OVERRIDES = (
    "environment.name=python",
    "environment.max_episode_tokens=200",
    "environment.observation_chars=48",
    "environment.timeout_s=0.25",
    "task.num_train=16",
    "task.num_eval=2",
    "rollout.prompts_per_batch=2",
    "rollout.group_size=2",
    "sampler.max_new_tokens=40",
    "sampler.slots=4",
    "sampler.page_size=256",
    "eval.num_problems=2",
    "eval.num_samples=2",
    "eval.ks=[1,2]",
    "eval.self_prm=false",
    # Greedy, on the memorised prompt only (the data is PROBLEM, written below): every row is
    # the memorised episode, three tool calls, on any CPU. At temperature 1, or on prompts
    # the model never saw, whether a row calls the tool is a matter of which token the
    # CPU's rounding tips a near-tie to (a fresh clone on an AMX CPU made none).
    "sampler.temperature=0",
    "eval.temperature=0",
)


def test_a_tool_batch_is_the_same_bytes_however_often_it_is_made(model, tmp_path):
    """Two workers (a retry after preemption: a fresh process, fresh engine and sandbox
    workers) make batch 0 from the memorised model: the same Parquet bytes, with the
    episode columns filled; the evaluator runs the same episodes and reports tool use.

    Why it holds on any CPU: the problem set is the memorised problem only and sampling is
    greedy, so every row is the memorised episode (each of its tokens is the argmax by the
    margin the `model` fixture checks, p > 0.98), with exactly three tool calls; the byte
    identity compares two makes on the same machine."""
    from pipeline.paramserver import ParamServer
    from pipeline.rollouts import from_parquet_bytes
    from pipeline.run import Run
    from tests.runs import tiny_config
    from tpu_jobs.evaluator import Evaluator
    from tpu_jobs.model.transformer import flat_params
    from tpu_jobs.rollout_worker import RolloutWorker

    run = Run.create(str(tmp_path / "run"), tiny_config(*WORKER_OVERRIDES))
    run.write_problems("train", [PROBLEM] * 16)
    run.write_problems("eval", [PROBLEM] * 2)
    ps = ParamServer(run.store)
    ps.publish(0, flat_params(model), epoch=ps.acquire_epoch())
    made = []
    for _ in range(2):
        worker = RolloutWorker(run, "w", log=lambda m: None)
        assert worker._ensure_version(0)
        made.append(to_parquet_bytes(worker.generate_batch(0, 0)))
    assert made[0] == made[1]
    batch = from_parquet_bytes(made[0])
    assert batch.is_episode().all() and batch.completion == ["".join(PIECES)] * 4
    assert batch.tool_calls == [3] * 4 and batch.reward.tolist() == [1.0] * 4
    for r in range(len(batch)):
        mask = np.asarray(batch.token_mask(r))
        assert (np.asarray(batch.behaviour_logprobs[r])[mask == 0] == 0).all()
    stats = worker.last_stats
    assert stats["tools"]["episodes"] == 4 and stats["generate_s"] > 0 and "tool_s" in stats

    record = Evaluator(run, log=lambda m: None).evaluate(0)
    assert record["tools"]["episodes"] == 4 and "pass@2" in record["metrics"]
    from pipeline.report import _tools_section

    section = "\n".join(_tools_section(run, [], [record]))
    assert "## Tool episodes (environment `python`)" in section and "| v0 |" in section
