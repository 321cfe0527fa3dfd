"""Multi-turn episodes with a tool: the token-level loop that drives the engine
(`tpu_jobs.generate.engine`) and an environment (`pipeline.environments`).

An episode of row r (prompt p_r, key k_r) runs in rounds:

1. Every live row samples one turn: a fresh `Request` (round 0) or a `Resume` of its
   parked request with the observation's tokens appended, so the history is never
   prefilled again (the engine continues from the turn's KV cache). A turn ends at EOS,
   at one of the environment's `stop_strings` (the Python tool's closing fence), or at its
   token limit: min(per-turn limit, what is left of `max_episode_tokens`).
2. The turns that ended on a stop string go to the environment together
   (`Environment.step_many`: the Python tool runs their programs in one
   `sandbox.execute_many`). Each answer is an observation and whether the episode is done.
3. The observation's tokens are appended to the completion with log-prob 0 and loss mask 0
   (the policy did not sample them); the row resumes in the next round.

An episode ends at EOS, when the environment says so (a turn with no call), after
`max_turns` turns, or when the budget is spent (a turn cut by its limit, or an observation
that would leave no room to sample). `finished` is True when it ended by EOS or by the
environment's word, False when a limit cut it. The verifier reads the final answer: the
text of the last turn, after the last observation (the tool's output itself never counts
as an answer); `failed_call_penalty` is subtracted per failed call.

Reproducibility. Row r's sampled token at sample index s draws with fold_in(k_r, s), and
a resumed turn continues the sample indices (`Resume`), so its tokens equal those of a
fresh prefill of the whole history (tests/tpu_jobs/test_episodes.py). Observations are
deterministic (`pipeline/environments/python_tool.py`), so an episode depends only on its
key, prompt, the weights and the environment config: a batch is the same whichever worker
makes it and however often.

Rows run in waves of at most the engine's slot count and, with a KV budget, of as many
rows as fit it at their full length (parked rows keep their pages between rounds, and the
engine preempts only live rows), so no round waits for pages a parked row holds. A wave's
rows form two halves that take turns: while the tool calls of one half's finished turns
run together (`Environment.step_many`, on a thread), the engine decodes the other half's
turns, so tool time hides behind decoding (`EpisodeTimes.tool_wait_s` is what it did not
hide). Within a half, a row that ended its turn early waits for the half's other rows
before its tool runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import EnvironmentConfig
from pipeline.environments import Environment, make_environment
from pipeline.tasks.base import Problem
from tpu_jobs.generate.engine import Engine, Request, Resume
from tpu_jobs.generate.interface import Sampler, SamplingParams
from tpu_jobs.generate.sample_verify import Scored, sample_and_verify, verify_rows
from tpu_jobs.generate.token_draw import key_data


@dataclass
class Episode:
    """One row's episode: every turn's sampled tokens and every observation's tokens, in
    order (`completion_ids`), with the behaviour log-probs (0 on observation tokens) and
    the loss mask (1 sampled, 0 observation)."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # turn, observation, turn, ...
    finished: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_errors: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def text(self) -> str:
        """The whole completion as a reader sees it (turns and observations)."""
        return "".join(self.pieces)

    @property
    def final_text(self) -> str:
        """What the verifier reads: the last turn (the text after the last observation)."""
        return self.pieces[-1] if self.pieces else ""

    def append(self, ids: Sequence[int], logprobs: Sequence[float], mask: int, text: str):
        self.completion_ids += [int(t) for t in ids]
        self.logprobs += [float(x) for x in logprobs]
        self.loss_mask += [mask] * len(ids)
        self.pieces.append(text)


@dataclass
class EpisodeTimes:
    """Seconds a call spent in the engine (`generate_s`), running the environment's tools
    (`tool_s`, on their thread) and waiting for them with nothing else to do (`tool_wait_s`:
    the part of tool_s that decoding did not hide); engine calls (`rounds`)."""

    generate_s: float = 0.0
    tool_s: float = 0.0
    tool_wait_s: float = 0.0
    rounds: int = 0


def turn_text(text: str, stops: Sequence[str]) -> str:
    """A stop-ended turn's text up to the end of its first stop string (a token may carry
    characters past it; they stay in the sequence, the environment reads the turn without
    them)."""
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text


def wave_size(engine: Engine, longest: int) -> int:
    """Rows per wave: the engine's slots, or fewer when its pool cannot hold that many
    rows of `longest` tokens (+ one page each: a row's partial page)."""
    per_row = -(-longest // engine.page_size) + 1
    return max(1, min(engine.max_slots, engine.num_pages // per_row))


def run_episodes(
    engine: Engine,
    model: Any,
    env: Environment,
    tok: Any,
    prompts: Sequence[Sequence[int]],
    keys: Any,
    cfg: EnvironmentConfig,
    params: SamplingParams,
) -> tuple[list[Episode], EpisodeTimes]:
    """One episode per row (`prompts[r]` with `keys[r]`, typed PRNG keys or uint32 key
    data [rows, 2]); each turn samples at most `params.max_new_tokens` tokens. Returns the
    episodes in row order and the time split."""
    if not isinstance(engine, Engine):
        raise ValueError(
            f"multi-turn episodes (environment.name={cfg.name!r}) need the continuous-batching "
            f"engine (sampler.engine='jax'), not {type(engine).__name__}"
        )
    times = EpisodeTimes()
    data = _key_data(keys, len(prompts))
    longest = max((len(p) for p in prompts), default=0) + cfg.max_episode_tokens
    wave = wave_size(engine, longest)
    episodes: list[Episode] = []
    for start in range(0, len(prompts), wave):
        rows = range(start, min(start + wave, len(prompts)))
        episodes += _run_wave(
            engine,
            model,
            env,
            tok,
            [prompts[r] for r in rows],
            data[start : start + len(rows)],
            cfg,
            times,
            params,
        )
    return episodes, times


def _key_data(keys: Any, n: int) -> np.ndarray:
    data = key_data(keys)
    if data.shape != (n, 2):
        raise ValueError(f"keys of shape {data.shape} for {n} prompts; expected ({n}, 2)")
    return data


def _run_wave(engine, model, env, tok, prompts, keys, cfg, times, params) -> list:
    """The wave's episodes, in two halves that take turns: while the tools of one half's
    finished turns run (on a thread: the sandbox waits on processes), the engine decodes
    the other half's turns."""
    n = len(prompts)
    max_turn = params.max_new_tokens
    eps = [Episode() for _ in range(n)]
    stops = tuple(env.stop_strings)
    requests: dict[int, Request | Resume] = {
        r: Request(
            list(prompts[r]),
            keys[r],
            min(max_turn, cfg.max_episode_tokens),
            stop_strings=stops,
            keep=True,
        )
        for r in range(n)
    }
    halves = [h for h in (list(range(0, n, 2)), list(range(1, n, 2))) if h]
    pending: dict[int, tuple[list[int], Future]] = {}  # half -> (rows, its tool calls)
    parked: dict[int, int] = {}  # row -> handle of its parked request
    tools = ThreadPoolExecutor(max_workers=len(halves), thread_name_prefix="tools")
    try:
        while requests or pending:
            for h, half in enumerate(halves):
                if h in pending:  # this half's tools: done while the other half decoded?
                    rows, future = pending.pop(h)
                    t0 = time.perf_counter()
                    answers, seconds = future.result()
                    times.tool_wait_s += time.perf_counter() - t0
                    times.tool_s += seconds
                    for r, answer in zip(rows, answers, strict=True):
                        request = _after_step(eps[r], answer, tok, cfg, parked[r], stops, max_turn)
                        if request is not None:
                            requests[r] = request
                            del parked[r]  # the Resume takes the handle
                    _release_done(engine, eps, parked)
                rows = [r for r in half if r in requests]
                if not rows:
                    continue
                ended = _turns(engine, model, [requests.pop(r) for r in rows], rows, eps, parked,
                               tok, cfg, stops, times, params)  # fmt: skip
                _release_done(engine, eps, parked)
                if ended:
                    turns = [t for _, t in ended]
                    pending[h] = ([r for r, _ in ended], tools.submit(_timed_steps, env, turns))
    finally:
        tools.shutdown(wait=True, cancel_futures=True)
        for handle in parked.values():
            engine.release(handle)
    return eps


def _timed_steps(env: Environment, turns: list[str]) -> tuple[list, float]:
    t0 = time.perf_counter()
    return env.step_many(turns), time.perf_counter() - t0


def _release_done(engine: Engine, eps: list[Episode], parked: dict[int, int]) -> None:
    for r in [r for r in parked if eps[r].done]:
        engine.release(parked.pop(r))


def _turns(engine, model, requests, rows, eps, parked, tok, cfg, stops, times, params):
    """Sample one turn of each row; record it; the (row, turn text) of the turns the
    environment must read (ended on a stop string, turns left)."""
    t0 = time.perf_counter()
    outs = engine.run(model, requests, params)  # each request: its turn's room
    times.generate_s += time.perf_counter() - t0
    times.rounds += 1
    ended: list[tuple[int, str]] = []
    for r, out in zip(rows, outs, strict=True):
        ep = eps[r]
        parked[r] = out.handle
        text = tok.decode(out.tokens)
        ep.turns += 1
        ep.append(out.tokens, out.logprobs, 1, text)
        if out.stop_reason == "eos":
            ep.done, ep.finished = True, True
        elif out.stop_reason == "length" or ep.turns >= cfg.max_turns:
            ep.done = True  # cut by a limit: the token budget or the turn count
        else:
            ended.append((r, turn_text(text, stops)))
    return ended


def _after_step(ep: Episode, answer, tok, cfg, handle, stops, max_turn) -> Resume | None:
    """Record the environment's answer to the row's turn; the next turn's Resume, or None
    when the episode ends here."""
    if answer.called:
        ep.tool_calls += 1
        if answer.error is not None:
            ep.tool_errors.append(answer.error)
    if answer.done or answer.observation is None:
        ep.done, ep.finished = True, True
        return None
    ids = tok.encode(answer.observation)
    room = cfg.max_episode_tokens - len(ep.completion_ids) - len(ids)
    if room < 1:  # no token could follow the observation
        ep.done = True
        return None
    ep.append(ids, [0.0] * len(ids), 0, answer.observation)
    return Resume(handle, ids, min(max_turn, room), stop_strings=stops, keep=True)


def sample_episodes_and_verify(
    engine: Engine,
    model: Any,
    tok: Any,
    env: Environment,
    cfg: EnvironmentConfig,
    problems: Sequence[Problem],
    keys: Any,
    params: SamplingParams,
) -> Scored:
    """`tpu_jobs.generate.sample_verify.sample_and_verify`'s contract for tool episodes: one episode per
    row, its final answer scored by its task's verifier, minus `failed_call_penalty` per
    failed call. The Scored carries the loss masks, turns, tool calls and errors and the
    time split (`generate_s`, `tool_s`)."""
    prompts = [tok.encode_prompt(p.prompt) for p in problems]
    episodes, times = run_episodes(
        engine,
        model,
        env,
        tok,
        prompts,
        keys,
        cfg,
        params,
    )
    t0 = time.perf_counter()
    verified = np.asarray(verify_rows(problems, [e.final_text for e in episodes]), np.float32)
    verify_s = time.perf_counter() - t0
    penalty = np.asarray([len(e.tool_errors) for e in episodes], np.float32)
    rewards = (verified - cfg.failed_call_penalty * penalty).astype(np.float32)
    return Scored(
        prompt_ids=prompts,
        completion_ids=[e.completion_ids for e in episodes],
        texts=[e.text for e in episodes],
        logprobs=[e.logprobs for e in episodes],
        lengths=np.asarray([len(e.completion_ids) for e in episodes], np.int32),
        finished=np.asarray([e.finished for e in episodes], bool),
        rewards=rewards,
        verify_s=verify_s,
        verify_wait_s=verify_s,
        loss_masks=[e.loss_mask for e in episodes],
        turns=[e.turns for e in episodes],
        tool_calls=[e.tool_calls for e in episodes],
        tool_errors=[e.tool_errors for e in episodes],
        final_texts=[e.final_text for e in episodes],
        generate_s=times.generate_s,
        tool_s=times.tool_s,
        tool_wait_s=times.tool_wait_s,
    )


def sample_rows(
    sampler: Sampler,
    model: Any,
    tok: Any,
    cfg: EnvironmentConfig,
    problems: Sequence[Problem],
    keys: Any,
    params: SamplingParams,
    *,
    env: Environment | None = None,
    batch_size: int | None = None,
    on_batch: Any = None,
) -> Scored:
    """One scored completion per row for every job that samples (rollout worker,
    evaluator, pass-rate job), sampled with `params` (the role's, `interface.sampling_params`):
    tool episodes when `cfg` (the run's `environment`) names an environment (`env`, or built
    from `cfg`; each turn takes at most `params.max_new_tokens` tokens), else
    `sample_verify.sample_and_verify` with its `batch_size` and `on_batch`."""
    if cfg.multi_turn:
        env = env or make_environment(cfg)
        return sample_episodes_and_verify(sampler, model, tok, env, cfg, problems, keys, params)
    return sample_and_verify(
        sampler, model, tok, problems, keys, params, batch_size=batch_size, on_batch=on_batch
    )
