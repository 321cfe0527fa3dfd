"""Adapter-only versions of a LoRA run against full bfloat16 and delta versions.

1. Measured at the `--preset` model (default `100m`), on the local store: a base (random
   weights of the preset's shapes, published as the run's `base/` in float32, as SFT and
   the HF import do), then per kind the bytes of one version and the time a worker takes
   to get it into the plain flat tensors its sampler loads:
   * full: a bfloat16 version, pulled with nothing held;
   * delta: a bfloat16 version stored as an XOR delta against the one before (an
     AdamW-sized step of `--lr` per element), pulled by a worker holding that version;
   * adapters, rank 8 and 64 (all seven projections): the version as published
     (bfloat16 adapters), pulled with `PolicyReader` by a worker that holds the base
     already, the merge (`pipeline.lora.merge`, NumPy float32) included; and the first
     pull of a fresh worker, which also reads the base once.
   Each time is the median of `--repeats` pulls with a fresh reader (no cache but the
   OS page cache, warm after the first).
2. Sampling with adapters, at the same preset: the model's decode step (64 rows, one new
   token each, against a 256-slot KV cache) and a prefill (16 x 256 tokens), jitted,
   with the adapters applied unmerged (an extra `(x @ A) @ B` per projection: the
   training forward, `tpu_jobs.model.transformer.Linear`) against the plain model that
   merged weights give; median of `--repeats` x 5 calls. Merging once per version pays
   when the merge (measured in 1) costs less than the unmerged overhead over the decode
   steps a version serves.
3. Computed for Qwen2.5-7B and Qwen2.5-32B shapes (HF config.json values): bytes of a full
   bfloat16 version, of an adapter version at rank 8 and 64, and of a delta version
   extrapolated with the delta/full ratio measured in 1.

    .venv/bin/python benchmarks/lora_versions.py [--preset 100m] [--repeats 3]

Writes benchmarks/results/lora_versions.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline import weight_codec  # noqa: E402
from pipeline.config import ModelConfig  # noqa: E402
from pipeline.leases import BatchLeases  # noqa: E402
from pipeline.lora import TARGETS, LoraConfig, adapter_shapes, merge  # noqa: E402
from pipeline.paramserver import ParamServer  # noqa: E402
from pipeline.paramserver.adapters import PolicyReader, server_base_digest  # noqa: E402
from pipeline.paramserver.publishing import Publisher, PublishPolicy  # noqa: E402
from pipeline.storage import LocalStore  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "lora_versions.md"
MIB = 1 << 20
RANKS = (8, 64)
# Hugging Face config.json values (Qwen/Qwen2.5-7B as tpu_jobs.learning.memory.QWEN25;
# Qwen/Qwen2.5-32B), untied heads, q/k/v biases.
SHAPES = {
    "Qwen2.5-7B": dict(
        hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944
    ),
    "Qwen2.5-32B": dict(
        hidden_size=5120, num_layers=64, num_heads=40, num_kv_heads=8, intermediate_size=27648
    ),
}
QWEN_VOCAB = {"Qwen2.5-7B": 152_064, "Qwen2.5-32B": 152_064}


def base_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The flat tensor names and shapes of a model (tpu_jobs/model/transformer.py's doc)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.embedding": (v, h), "norm.weight": (h,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.kernel"] = (h, v)
    for n in range(cfg.num_layers):
        p = f"layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.kernel": (h, q),
            p + "self_attn.k_proj.kernel": (h, kv),
            p + "self_attn.v_proj.kernel": (h, kv),
            p + "self_attn.o_proj.kernel": (q, h),
            p + "mlp.gate_proj.kernel": (h, i),
            p + "mlp.up_proj.kernel": (h, i),
            p + "mlp.down_proj.kernel": (i, h),
        }
        if cfg.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def version_bytes(ps: ParamServer, version: int, kind: str) -> int:
    return sum(s["size"] for s in ps.manifest(version)[kind]["shards"])


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def policy(**changes) -> PublishPolicy:
    base = PublishPolicy(
        dtype="bfloat16",
        parts=1,
        full_every=1,
        publish_every=1,
        keep_versions=0,
        max_staleness=0,
        clock_skew_s=0.0,
    )
    return dataclasses.replace(base, **changes)


def no_split(shapes, parts):
    return dict.fromkeys(shapes)


def measure(args, root: Path) -> dict:
    cfg = ModelConfig(preset=args.preset)
    shapes = base_shapes(cfg)
    rng = np.random.default_rng(0)
    base = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    n_params = sum(v.size for v in base.values())
    out: dict = {"preset": args.preset, "params": n_params, "rows": []}
    store = LocalStore(root / "run")
    base_ps = ParamServer(store.child("base/"))
    base_ps.publish(0, base, epoch=base_ps.acquire_epoch())

    # Full and delta bfloat16 versions of the whole model.
    full_store = LocalStore(root / "full")
    pub = Publisher(
        ParamServer(full_store),
        BatchLeases(full_store, ttl_seconds=30),
        policy(full_every=10),
        no_split,
        log=lambda m: None,
    )
    epoch = pub.ps.acquire_epoch()
    pub.publish(0, base, epoch=epoch, step=0, next_batch=0)
    step = {
        k: (args.lr * np.sign(rng.standard_normal(v.shape))).astype(np.float32)
        for k, v in base.items()
    }
    moved = {k: base[k] + step[k] for k in base}
    pub.publish(1, moved, epoch=epoch, step=1, next_batch=1)
    b0 = weight_codec.cast_for_publish(base, "bfloat16")
    b1 = weight_codec.cast_for_publish(moved, "bfloat16")
    changed = sum(int(np.count_nonzero(b0[k].view(np.uint16) != b1[k].view(np.uint16))) for k in b0)
    out["delta_changed_fraction"] = changed / n_params
    held = ParamServer(full_store).pull(0)
    full_s = timed(lambda: ParamServer(full_store).pull(0), args.repeats)
    delta_s = timed(lambda: ParamServer(full_store).pull(1, have=held), args.repeats)
    full_b = version_bytes(pub.ps, 0, "full")
    delta_b = version_bytes(pub.ps, 1, "delta")
    out["rows"].append(("full bfloat16", full_b, full_s, None))
    out["rows"].append(
        (f"delta bfloat16 (held v0, {changed / n_params:.0%} changed)", delta_b, delta_s, None)
    )
    out["delta_ratio"] = delta_b / full_b

    for rank in RANKS:
        lora = LoraConfig(rank=rank, alpha=2.0 * rank)
        a_shapes = adapter_shapes(shapes, lora)
        adapters = {
            k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in a_shapes.items()
        }
        rstore = LocalStore(root / f"r{rank}")
        rbase = ParamServer(rstore.child("base/"))
        rbase.publish(0, base, epoch=rbase.acquire_epoch())
        digest = server_base_digest(rbase)[1]
        rpub = Publisher(
            ParamServer(rstore),
            BatchLeases(rstore, ttl_seconds=30),
            policy(base_digest=digest, lora_scale=lora.scale),
            no_split,
            log=lambda m: None,
        )
        rpub.publish(0, adapters, epoch=rpub.ps.acquire_epoch(), step=0, next_batch=0)
        warm = PolicyReader(ParamServer(rstore), ParamServer(rstore.child("base/")))
        warm.pull(0)  # holds the base from here on

        def steady(warm=warm):
            warm.pull(0, held=None)  # the adapters pulled anew; the base stays held

        first_s = timed(
            lambda rstore=rstore: PolicyReader(
                ParamServer(rstore), ParamServer(rstore.child("base/"))
            ).pull(0),
            args.repeats,
        )
        steady_s = timed(steady, args.repeats)
        merge_s = timed(lambda a=adapters, s=lora.scale: merge(base, a, s), args.repeats)
        ab = version_bytes(rpub.ps, 0, "full")
        out["rows"].append((f"adapters rank {rank} (base held)", ab, steady_s, merge_s))
        out["rows"].append((f"adapters rank {rank}, first pull (+ base)", ab, first_s, merge_s))
    return out


def sampling_cost(args) -> dict:
    """ms per decode step and per prefill: the plain model (what merged weights give) and
    the model with unmerged adapters of each rank (`--ranks`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tpu_jobs.model.transformer import init_cache, init_model

    cfg = ModelConfig(preset=args.preset)
    rows, cache_len, pre_b, pre_t = 64, 256, 16, 256

    def timings(model) -> tuple[float, float]:
        graphdef, state = nnx.split(model)

        @jax.jit
        def step(state, tokens, positions, mask, cache, index):
            return nnx.merge(graphdef, state)(tokens, positions, mask, cache, index)[0]

        cache = init_cache(cfg, rows, cache_len)
        cache = dataclasses.replace(cache, mask=jnp.ones_like(cache.mask))
        tok = jnp.ones((rows, 1), jnp.int32)
        pos = jnp.full((rows, 1), cache_len // 2, jnp.int32)
        index = jnp.int32(cache_len // 2)
        pre = jnp.ones((pre_b, pre_t), jnp.int32)
        pre_pos = jnp.broadcast_to(jnp.arange(pre_t, dtype=jnp.int32), (pre_b, pre_t))

        def decode():
            step(state, tok, pos, jnp.ones_like(tok), cache, index).block_until_ready()

        prefill_fn = jax.jit(lambda st, t, p_, m: nnx.merge(graphdef, st)(t, p_, m)[0])

        def prefill():
            prefill_fn(state, pre, pre_pos, jnp.ones_like(pre)).block_until_ready()

        decode(), prefill()  # compile
        n = 5 * args.repeats
        return 1e3 * timed(decode, n), 1e3 * timed(prefill, n)

    out = {"plain": timings(init_model(cfg, 0))}
    for rank in args.ranks:
        out[rank] = timings(init_model(cfg, 0, LoraConfig(rank=rank)))
    return out


def computed() -> list[tuple[str, int, dict[int, int]]]:
    rows = []
    for name, dims in SHAPES.items():
        cfg = ModelConfig(**dims, vocab_size=QWEN_VOCAB[name], qkv_bias=True, tie_embeddings=False)
        shapes = base_shapes(cfg)
        full = 2 * sum(int(np.prod(s)) for s in shapes.values())
        ranks = {}
        for rank in RANKS:
            a = adapter_shapes(shapes, LoraConfig(rank=rank, targets=tuple(TARGETS)))
            ranks[rank] = 2 * sum(int(np.prod(s)) for s in a.values())
        rows.append((name, full, ranks))
    return rows


def _merge_break_even(m: dict) -> list[str]:
    """How many decode steps of unmerged overhead one merge per version pays for."""
    plain = m["sampling"]["plain"][0]
    merges = {
        rank: merge_s
        for name, _, _, merge_s in m["rows"]
        for rank in (8, 64)
        if merge_s is not None and name.startswith(f"adapters rank {rank} (")
    }
    out = []
    for rank, merge_s in sorted(merges.items()):
        if rank not in m["sampling"]:
            continue
        extra = m["sampling"][rank][0] - plain
        steps = "never (no overhead measured)" if extra <= 0 else f"{1e3 * merge_s / extra:,.0f}"
        out.append(
            f"- rank {rank}: a merge ({merge_s:.3f} s per version) costs as much as the "
            f"unmerged overhead of {steps} decode steps of 64 rows (+{extra:.1f} ms each)."
        )
    return out


def report(m: dict, comp, args) -> str:
    lines = [
        "# LoRA adapter versions vs full and delta versions",
        "",
        f"`.venv/bin/python benchmarks/lora_versions.py --preset {args.preset} "
        f"--repeats {args.repeats}` on {platform.machine()}, {os.cpu_count()} CPUs "
        "(shared), local store (a directory; page cache warm after the first pull).",
        "",
        f"## Measured: `{m['preset']}` preset ({m['params'] / 1e6:.1f}M parameters)",
        "",
        "Pull = what a worker does to get plain flat tensors its sampler loads "
        "(`PolicyReader.pull`: download, crc32c checks, delta rebuild, and for adapters the "
        "merge into the held float32 base). Median of "
        f"{args.repeats}.",
        "",
        "| version | bytes | vs full | pull (s) | of which merge (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    full_b = m["rows"][0][1]
    for name, b, s, merge_s in m["rows"]:
        ms = "" if merge_s is None else f"{merge_s:.3f}"
        lines.append(
            f"| {name} | {b / MIB:,.2f} MiB | {full_b / b:,.0f}x smaller | {s:.3f} | {ms} |"
            if b != full_b
            else f"| {name} | {b / MIB:,.2f} MiB | 1x | {s:.3f} | {ms} |"
        )
    lines += [
        "",
        f"The delta's step: +-{args.lr:g} per element (an AdamW step at lr {args.lr:g}), which "
        f"changed {m['delta_changed_fraction']:.0%} of the bfloat16 elements "
        "(benchmarks/results/paramserver_deltas.md measured 6-58% on a real run).",
        "",
        "## Measured: sampling with merged weights vs unmerged adapters",
        "",
        "The model's decode step (64 rows x 1 token, 256-slot KV cache) and a prefill "
        f"(16 x 256 tokens) at `{m['preset']}`, jitted; median of {5 * args.repeats} calls. "
        "Merged: the plain model (what `pipeline.lora.merge` gives the samplers).",
        "",
        "| weights | decode step (ms) | vs merged | prefill (ms) | vs merged |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {'merged (plain kernels)' if k == 'plain' else f'unmerged adapters, rank {k}'} "
            f"| {d:.1f} | {d / m['sampling']['plain'][0]:.2f}x | {f:.1f} "
            f"| {f / m['sampling']['plain'][1]:.2f}x |"
            for k, (d, f) in m["sampling"].items()
        ),
        "",
        *_merge_break_even(m),
        "",
        "## Computed: bytes per version at real shapes (bfloat16, all seven projections)",
        "",
        "Delta: the full version times the delta/full ratio measured above "
        f"({m['delta_ratio']:.2f}); it depends on the changed fraction, adapters do not.",
        "",
        "| model | full | delta (est.) | adapters r=8 | adapters r=64 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, full, ranks in comp:
        lines.append(
            f"| {name} | {full / 2**30:,.2f} GiB | {full * m['delta_ratio'] / 2**30:,.2f} GiB | "
            f"{ranks[8] / MIB:,.1f} MiB ({full / ranks[8]:,.0f}x) | "
            f"{ranks[64] / MIB:,.1f} MiB ({full / ranks[64]:,.0f}x) |"
        )
    lines += [
        "",
        "## Reading",
        "",
        "- An adapter version is its A and B matrices only: (d_in + d_out) x rank per "
        "projection, independent of the vocabulary and of how far a step moved the weights.",
        "- A worker merges each version once (`pipeline.lora.merge`, float32 NumPy) into the "
        "base it holds; the samplers and decode layouts then read plain kernels, so sampling "
        "costs what it costs without LoRA. The merge is the larger part of an adapter pull "
        "here; unmerged sampling (an extra (x @ A) @ B per projection and token) is not "
        "faster in the table above at any rank, so it is not implemented.",
        "- The first pull of a fresh worker reads the float32 base once (the run's `base/`).",
        "- On the local store a full pull is memory-mapped shard files checked by crc32c, no "
        "copy, so it is the fastest here; over a network the bytes dominate (a 7B full "
        "version is 14 GiB against 38-308 MiB of adapters; docs/scale-model.md's egress). "
        "The merge's ~0.2 s at 100m scales with the base's projection sizes (one float32 "
        "pass over each target kernel).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--ranks", default="8,64", help="adapter ranks of the sampling rows")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    args.ranks = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        m = measure(args, Path(tmp))
    m["sampling"] = sampling_cost(args)
    text = report(m, computed(), args)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
