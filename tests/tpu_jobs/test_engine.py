"""The continuous-batching engine (tpu_jobs.generate.engine) against the static sampler on the same
keys, and the page pool's bookkeeping (tpu_jobs.generate.kv_pages).

One reference batch from the static sampler serves every comparison: 16 distinct prompts
and a group of 4 copies of one prompt (G samples), on a model whose EOS follows trigger
tokens, so rows end at different steps. Every engine here runs with `check=True`: the
pool's reference counts are checked against the rows' block tables after each chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tpu_jobs.test_sampler import CFG, EOS, PAD, PROMPTS, TRIGGERS, keys_for, random_model
from tpu_jobs.generate.decode_layouts import DECODE_LAYOUTS
from tpu_jobs.generate.engine import Engine, Request, Resume
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.generate.kv_pages import PACKED_PAGES, PagePool, PoolExhausted, pack, unpack
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.generate.vllm_sampler import VllmSampler
from tpu_jobs.model.transformer import init_model

MAX_NEW = 12
GROUP = [1, 9, 8, 7, 6, 5]  # the shared prompt of the group rows
ROWS = [PROMPTS[i % 3] + [30 + i] for i in range(16)] + [GROUP] * 4
TEMPS = (1.0, 0.6)


def engine(**kw) -> Engine:
    """Every engine here has 4 slots (so 20 rows refill them), a pool of 12 pages of 4
    tokens (too small for 4 rows of full length: rows get preempted) and the same buckets:
    the programs compile once for the whole file."""
    settings = dict(pad_id=PAD, eos_id=EOS, max_slots=4, row_buckets=(4,), kv_tokens=48)
    # Prompt bucket 32: every prefill, and every chunk's block table (8 pages), one shape.
    settings.update(page_size=4, chunk=4, prompt_buckets=(32,), check=True)
    return Engine(CFG, **{**settings, **kw})


@pytest.fixture(scope="module")
def model():
    return random_model(seed=1, triggers=TRIGGERS)


@pytest.fixture(scope="module")
def keys():
    return keys_for(len(ROWS), seed=7)


@pytest.fixture(scope="module")
def reference(model, keys):
    """The static sampler's batch at each temperature (one compiled program)."""
    sampler = StaticSampler(CFG, pad_id=PAD, eos_id=EOS, decode_layout="token_major")
    return {
        t: sampler.generate(
            model, ROWS, keys, SamplingParams(max_new_tokens=MAX_NEW, temperature=t)
        )
        for t in TEMPS
    }


def assert_same(out, ref, rows=slice(None)):
    np.testing.assert_array_equal(out.tokens, ref.tokens[rows])
    np.testing.assert_array_equal(out.lengths, ref.lengths[rows])
    np.testing.assert_array_equal(out.finished, ref.finished[rows])
    assert np.abs(out.logprobs - ref.logprobs[rows]).max() <= 1e-5


@pytest.mark.parametrize("layout", list(DECODE_LAYOUTS))
def test_engine_equals_static_sampler_on_the_same_keys(model, keys, reference, layout):
    """In both decode layouts: feature_major (the CPU default from hidden size 256, fused
    projections over the rows' cache in the per-layer layout) and the model's own forward."""
    ref = reference[1.0]
    assert ref.finished.sum() >= 4 and (~ref.finished).sum() >= 2  # ragged lengths
    eng = engine(decode_layout=layout)
    assert eng.decode_layout == layout
    for t in TEMPS:
        assert_same(
            eng.generate(model, ROWS, keys, SamplingParams(max_new_tokens=MAX_NEW, temperature=t)),
            reference[t],
        )
    assert eng.pool.in_use == 0  # every page back at the end


def test_refill_never_mixes_rows_and_groups_prefill_once(model, keys, reference):
    """4 slots for 20 rows, in another order: rows enter other slots beside other rows as
    others stop; each keeps its own tokens."""
    eng = engine()
    order = np.random.default_rng(0).permutation(len(ROWS))
    rows = [ROWS[i] for i in order]
    out = eng.generate(model, rows, keys[order], SamplingParams(max_new_tokens=MAX_NEW))
    assert_same(out, reference[1.0], order)
    assert eng.stats["chunks"] >= 8  # refilled many times
    assert eng.stats["sampled_tokens"] == int(reference[1.0].lengths.sum())
    # One prefill per distinct prompt: the 4 group rows share one.
    assert eng.stats["prefill_rows"] == 17
    assert eng.stats["prefill_tokens"] == sum(map(len, ROWS[:16])) + len(GROUP)
    assert eng.pool.in_use == 0


def test_shared_prefix_rows_equal_independent_rows(model, keys, reference):
    eng = engine()
    group = eng.generate(model, ROWS[16:], keys[16:], SamplingParams(max_new_tokens=MAX_NEW))
    assert_same(group, reference[1.0], slice(16, None))  # the static rows are independent
    assert eng.stats["prefill_rows"] == 1
    # The prompt's full page is held once for the 4 rows (plus each row's own pages).
    own = sum(-(-(len(GROUP) + n) // 4) - 1 for n in group.lengths.tolist())
    assert eng.stats["peak_pages"] <= 1 + own + 1


def test_preempted_rows_recompute_the_same_tokens(model, keys, reference):
    """A budget too small for 4 rows of full length: the newest rows are preempted (their
    pages freed) and later recomputed from their history."""
    eng = engine()
    assert_same(
        eng.generate(model, ROWS, keys, SamplingParams(max_new_tokens=MAX_NEW)), reference[1.0]
    )
    assert eng.stats["preemptions"] >= 1
    assert eng.stats["peak_pages"] <= 12 and eng.pool.in_use == 0


def test_stop_sequences_stop_at_the_right_token(model, keys, reference):
    ref = reference[1.0]
    row = int(np.argmax(ref.lengths))  # a long row
    gen = ref.tokens[row, : ref.lengths[row]].tolist()
    stop = gen[3:5]
    end = next(i + 2 for i in range(len(gen) - 1) if gen[i : i + 2] == stop)  # first match
    letters = "".join(chr(ord("a") + t % 26) for t in gen)
    eng = engine(detokenize=lambda ids: "".join(chr(ord("a") + t % 26) for t in ids))
    key = keys[row]
    never = [[CFG.vocab_size - 1] * 5]
    out = eng.run(
        model,
        [
            Request(ROWS[row], key, MAX_NEW, stop=[stop]),
            Request(ROWS[row], key, MAX_NEW, stop_strings=[letters[6:8]]),
            Request(ROWS[row], key, MAX_NEW, stop=never),
        ],
    )
    assert out[0].tokens == gen[:end] and out[0].stop_reason == "stop" and out[0].finished
    s_end = next(i + 1 for i in range(len(gen)) if letters[6:8] in letters[: i + 1])
    assert out[1].tokens == gen[:s_end] and out[1].stop_reason == "stop"
    assert out[2].tokens == gen  # a sequence that never occurs changes nothing
    np.testing.assert_allclose(out[0].logprobs, ref.logprobs[row, :end], atol=1e-5)
    assert eng.pool.in_use == 0


def test_resumed_request_equals_fresh_prefill_of_its_history(model, keys):
    eng = engine()
    prompt, key = [1, 12, 13, 14, 15, 16, 18], keys[3]
    first = eng.run(model, [Request(prompt, key, 6, keep=True)])[0]
    assert first.handle is not None and eng.pool.in_use > 0  # parked with its cache
    tool = [20, 21, 22, 23, 24]  # appended tokens (a tool's output)
    resumed = eng.run(model, [Resume(first.handle, tool, 7)])[0]
    history = prompt + first.tokens + tool
    fresh = eng.run(model, [Request(history, key, 7, first_step=len(first.tokens))])[0]
    assert resumed.tokens == fresh.tokens and len(resumed.tokens) >= 1
    np.testing.assert_allclose(resumed.logprobs, fresh.logprobs, atol=1e-5)
    assert eng.pool.in_use == 0  # a resumed request without keep releases its pages
    with pytest.raises(ValueError, match="not parked"):
        eng.run(model, [Resume(first.handle, tool, 7)])


def test_page_pool_never_hands_out_a_page_twice():
    pool = PagePool(6)
    a, b = pool.alloc(2), pool.alloc(3)
    assert a == [0, 1] and b == [2, 3, 4] and pool.num_free == 1
    pool.share(a)  # a second sequence reads the same prompt pages
    pool.check([a, b, a])
    pool.release(a)
    assert pool.num_free == 1  # still held once
    with pytest.raises(PoolExhausted):
        pool.alloc(2)
    pool.release(a)
    c = pool.alloc(3)
    assert c == [0, 1, 5] and not set(c) & set(b)
    with pytest.raises(AssertionError, match="disagree"):
        pool.check([b])  # c's holder missing
    pool.release(b + c)
    assert pool.num_free == 6 and pool.peak_in_use == 6
    with pytest.raises(AssertionError, match="released while free"):
        pool.release([0])


def test_request_longer_than_the_budget_is_refused(model, keys):
    eng = engine(kv_tokens=32)
    with pytest.raises(ValueError, match=r"request 1 needs 40 tokens of KV cache.*budget of 32"):
        eng.run(model, [Request([1, 2], keys[0], 4), Request([1] * 10, keys[1], 30)])
    with pytest.raises(ValueError, match="stop_strings.*detokenize"):
        eng.run(model, [Request([1, 2], keys[0], 4, stop_strings=["x"])])
    with pytest.raises(ValueError, match="attention='flash'.*'gather'"):
        engine(attention="flash")
    with pytest.raises(ValueError, match="uint32 key data of shape"):
        eng.run(model, [Request([1, 2], np.zeros(2, np.int64), 4)])
    with pytest.raises(ValueError, match=r"prompt 0 has 2 tokens \+ max_new_tokens=255 > model"):
        eng.generate(model, [[1, 2]], keys[:1], SamplingParams(max_new_tokens=255))
    assert jax.tree.leaves(eng.pages)  # the pool survives refused calls


def test_sampler_engine_setting_picks_the_sampler():
    from pipeline.config import load_config
    from pipeline.errors import ConfigError
    from pipeline.tokenizer import get_tokenizer
    from tpu_jobs.generate.registry import make_sampler

    tok = get_tokenizer("char")
    cfg = load_config(
        None, ["sampler.slots=8", "sampler.kv_token_budget=4096", "sampler.page_size=8"]
    )
    eng = make_sampler(cfg, tok)  # the default
    assert isinstance(eng, Engine) and (eng.max_slots, eng.num_pages) == (8, 512)
    assert eng.eos_id == tok.eos_id and eng.detokenize == tok.decode
    assert isinstance(
        make_sampler(load_config(None, ["sampler.engine=static"]), tok), StaticSampler
    )
    with pytest.raises(ConfigError, match="sampler.engine.*'jax', 'static'"):
        load_config(None, ["sampler.engine=sglang"])
    # vllm: configured here, started (from its own virtualenv) by the first generate.
    vllm = make_sampler(
        load_config(
            None,
            [
                "sampler.engine=vllm",
                "trainer.is_correction=tis",
                "sampler.slots=8",
                "sampler.vllm_python=/nonexistent/python",
                "sampler.vllm_args=[--enforce-eager]",
            ],
        ),
        tok,
    )
    assert isinstance(vllm, VllmSampler) and vllm.server is None
    assert vllm.args[vllm.args.index("--max-num-seqs") + 1] == "8"
    assert vllm.args[-1] == "--enforce-eager" and vllm.eos_id == tok.eos_id
    model = init_model(vllm.model_cfg, 0)
    keys = jax.random.split(jax.random.key(0), 1)
    with pytest.raises(ValueError, match="dtype='bfloat16' is invalid.*allowed: 'float32'"):
        vllm.generate(model, [[1, 5]], keys, SamplingParams(max_new_tokens=4, dtype="bfloat16"))
    with pytest.raises(ValueError, match="prompt 0 has 3 tokens.*model.max_seq_len=256"):
        vllm.generate(model, [[1, 5, 6]], keys, SamplingParams(max_new_tokens=254))
    with pytest.raises(FileNotFoundError, match="make .venv-vllm/.installed"):
        vllm.generate(model, [[1, 5]], keys, SamplingParams(max_new_tokens=4))
    vllm.close()


def test_stats_count_live_row_steps_and_time_each_phase(model, keys):
    """The profile benchmarks/engine.py reports: every decode row-step is a live row's
    (a token emitted) or padding, and each phase's seconds are its own."""
    eng = engine(kv_tokens=256, profile=True)  # room for every row: no preemption
    out = eng.generate(model, ROWS, keys, SamplingParams(max_new_tokens=MAX_NEW))
    stats = eng.stats
    assert stats["preemptions"] == 0
    # Each row's first token comes from its admission, the rest from decode chunks.
    assert stats["live_row_steps"] == out.lengths.sum() - len(ROWS)
    chunks = sum(eng.chunk_shapes.values())
    assert chunks == stats["chunks"]
    # A chunk ends early once no row is live (one row bucket here): at most `chunk` steps.
    assert stats["decode_row_steps"] <= sum(
        rows * eng.chunk * n for (rows, _), n in eng.chunk_shapes.items()
    )
    assert stats["live_row_steps"] < stats["decode_row_steps"]  # ragged rows leave padding
    assert min(stats[k] for k in ("prefill_s", "admit_s", "decode_s", "host_s")) > 0


def test_a_chunk_ends_once_its_live_rows_fit_the_next_smaller_bucket(model, keys):
    """Planted lengths (no EOS): 5 rows of 3 tokens and 3 of 20, 8 slots, buckets of 4
    and 8 rows, chunks of 8 steps. Each row's first token comes from its admission.
    Chunk 1 (8 rows) ends after 2 steps, when the short rows stop and 3 live rows fit 4;
    then 4-row chunks of 8, 8 and 1 step (the last ends when every row has stopped): 17
    more steps for the long rows. Without the early ends: 8 x 8 + 3 chunks x 4 x 8 = 160.
    The tokens equal a run whose rows' chunks never end early (one bucket of 8)."""
    lengths = [3] * 5 + [20] * 3
    requests = [Request(ROWS[i], keys[i], n) for i, n in enumerate(lengths)]
    settings = dict(pad_id=PAD, eos_id=-1, max_slots=8, chunk=8, page_size=4)
    settings.update(prompt_buckets=(32,), check=True)
    eng = Engine(CFG, row_buckets=(4, 8), **settings)
    out = eng.run(model, requests)
    assert [len(c.tokens) for c in out] == lengths
    assert eng.stats["chunks"] == 4
    assert eng.stats["decode_row_steps"] == 8 * 2 + 4 * (8 + 8 + 1)
    assert eng.stats["live_row_steps"] == sum(lengths) - len(lengths)
    assert dict(eng.chunk_shapes) == {(8, 16): 1, (4, 16): 3}
    whole = Engine(CFG, row_buckets=(8,), **settings).run(model, requests)
    for a, b in zip(out, whole, strict=True):
        assert a.tokens == b.tokens
        assert np.abs(np.subtract(a.logprobs, b.logprobs)).max() <= 1e-5


def test_default_row_buckets_are_powers_of_two():
    assert Engine(CFG, max_slots=64).slot_buckets == (4, 8, 16, 32, 64)
    assert Engine(CFG, max_slots=48).slot_buckets == (4, 8, 16, 32, 48)
    assert Engine(CFG, max_slots=2).slot_buckets == (2,)


def test_packed_bfloat16_pages_hold_the_exact_bits():
    """A bfloat16 pool on XLA:CPU is uint32 words, two head-dim values each (little end
    first): NumPy's view of the same bfloat16 bits, and unpacking gives them back."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 2, 8)) * 100, jnp.bfloat16)
    like = jnp.zeros((1, 4), jnp.uint32)
    words = pack(x, like)
    assert words.dtype == jnp.uint32 and words.shape == (3, 2, 4)
    np.testing.assert_array_equal(np.asarray(words), np.asarray(x).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(unpack(words)).view(np.uint16),
                                  np.asarray(x).view(np.uint16))  # fmt: skip
    plain = jnp.zeros((1, 8), jnp.float32)
    np.testing.assert_array_equal(pack(x, plain), np.asarray(x, np.float32))
    assert unpack(plain) is plain


def test_bfloat16_engine_is_the_same_with_packed_or_plain_pages(model, keys, monkeypatch):
    """bfloat16 rows through packed pages (the XLA:CPU default) and through a plain
    bfloat16 pool: the same tokens and log-probs, bit for bit."""
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, dtype="bfloat16")
    packed = engine()
    out = packed.generate(model, ROWS, keys, params)
    assert packed.pages.k[0].dtype == jnp.uint32
    assert packed.pages.k[0].shape[-1] == CFG.head_dim // 2
    monkeypatch.delitem(PACKED_PAGES, ("cpu", "bfloat16"))
    plain = engine()
    ref = plain.generate(model, ROWS, keys, params)
    assert plain.pages.k[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(out.logprobs, ref.logprobs)
    assert (out.lengths >= 4).sum() >= 10 and packed.stats["preemptions"] > 0  # paged, preempted


@pytest.mark.parametrize(
    ("layout", "dtype"), [("feature_major", "bfloat16"), ("token_major", "float32")]
)
def test_resuming_from_the_last_chunks_copy_equals_gathering_the_pages(model, keys, layout, dtype):
    """A chunk over the same rows as the last one resumes from that chunk's copy of their
    cache (`resident_rows`) instead of gathering their pages, and a chunk of fewer rows
    (buckets of 2 and 4 rows here) copies its rows out of it: the same tokens and
    log-probs, bit for bit, through refills, stopped rows (left as padding rows), chunks
    that end early and preemptions."""
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, dtype=dtype)
    kept = engine(decode_layout=layout, row_buckets=(2, 4))
    out = kept.generate(model, ROWS, keys, params)
    fresh = engine(decode_layout=layout, row_buckets=(2, 4), resident_rows=False)
    ref = fresh.generate(model, ROWS, keys, params)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(out.logprobs, ref.logprobs)
    assert fresh.stats["resumed_chunks"] == 0
    assert 0 < kept.stats["compacted_chunks"] < kept.stats["resumed_chunks"]
    assert kept.stats["resumed_chunks"] < kept.stats["chunks"]
    assert set(kept.chunk_shapes) == set(fresh.chunk_shapes) == {(2, 16), (4, 16)}
    assert kept.stats["preemptions"] > 0 and kept._last is None  # the copy is not kept after
