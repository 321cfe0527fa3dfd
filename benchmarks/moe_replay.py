"""Routing replay on the MoE demo model, and the delta ratio of a MoE run's versions.

1. Alignment (issue 38, item 4), in the style of tests/tpu_jobs/test_alignment.py: the
   `demo_moe` preset (configs/demo.yaml's task and sampling) at its random initialisation
   and after `--sft-steps` SFT steps; batch 0 (`--prompts` x `--group` rows) sampled by the
   rollout worker's engine in bfloat16 and in float32, each row's routing recorded; the
   float32 trainer (`tpu_jobs.learning.step.Learner`) recomputes the completion tokens'
   log-probs with routing replay off and on. Per case: mean and max |logp_trainer -
   logp_sampler| over the completion tokens, the importance ratio pi_old / pi_behaviour
   the trainer's step logs (`is_ratio_*`), and the share of tokens whose top-k set
   differs between the sampler's record and the trainer's own routers (per (token,
   layer), and tokens with any layer differing), over the tokens the sampler recorded.
2. Deltas (item 5): `--delta-steps` on-policy GRPO steps from the random initialisation
   (the worker samples each batch from the current weights, as with max_staleness 0) with
   an entropy bonus (`--entropy-coef`), as benchmarks/paramserver_deltas.py does: the
   base earns no reward, so without it GRPO's advantages, the gradients and the deltas
   are all zero (measured: 0 changed elements in 4 steps from the SFT 200 model, whose
   groups all scored 0). Each version cast to bfloat16 as the parameter server publishes it: the share of elements that changed
   per step, overall and for the experts, the routers and the rest; and, per step, the
   (layer, expert) pairs the batch sent no token to and whether their weights changed.

    .venv/bin/python benchmarks/moe_replay.py [--sft-steps 200] [--delta-steps 4]
        [--entropy-coef 0.01] [--deltas-only: keep the results file's alignment rows]

Writes benchmarks/results/moe_replay.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import load_config  # noqa: E402
from pipeline.problem_sets import write_data  # noqa: E402
from pipeline.run import Run, base_server  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "moe_replay.md"


def make_run(args, root: Path) -> Run:
    cfg = load_config(
        ROOT / "configs/demo.yaml",
        [
            "model.preset=demo_moe",
            f"seed={args.seed}",
            f"rollout.prompts_per_batch={args.prompts}",
            f"rollout.group_size={args.group}",
            "trainer.max_staleness=0",
            f"trainer.lr={args.lr}",
            "trainer.warmup_steps=0",  # the deltas' first steps at the full lr
            f"trainer.entropy_coef={args.entropy_coef}",
            "trainer.routing_replay=true",
            "sampler.engine=jax",
            "task.num_train=2000",
            "task.num_eval=10",
            f"sft.steps={max(args.sft_steps, 1)}",
            "sft.target_loss=0",
        ],
    )
    run = Run.create(str(root / "run"), cfg)
    write_data(run)
    return run


def publish_random_base(run: Run) -> None:
    from tpu_jobs.model.transformer import flat_params, init_model

    cfg = run.config
    base = base_server(run)
    flat = {k: np.asarray(v) for k, v in flat_params(init_model(cfg.model, cfg.seed)).items()}
    base.publish(0, flat, epoch=base.acquire_epoch(), metadata={"init": "random"})


def routing_stats(batch, learner, params) -> dict[str, float]:
    """Top-k sets of the sampler's record against the trainer's own float32 routers."""
    import jax.numpy as jnp

    from tpu_jobs.learning.value_head import policy_forward_and_router

    inp = learner.inputs(batch)
    model = learner.fns.merge(params["policy"])
    _, router = policy_forward_and_router(model, jnp.asarray(inp.tokens), jnp.asarray(inp.mask))
    own = np.sort(np.moveaxis(np.asarray(router.experts), 0, 2), axis=-1)  # [R, T, L, k]
    rec = np.sort(np.asarray(inp.routing), axis=-1)
    recorded = np.all(rec < learner.cfg.model.num_experts, axis=-1)  # [R, T, L]
    differs = np.any(own != rec, axis=-1) & recorded
    tokens = recorded.all(axis=-1)
    return {
        "topk_differs_token_layer": float(differs.sum() / recorded.sum()),
        "topk_differs_token": float(differs.any(axis=-1)[tokens].mean()),
        "recorded_tokens": int(tokens.sum()),
    }


def alignment(run: Run, label: str) -> list[dict]:
    from tpu_jobs.learning.step import Learner
    from tpu_jobs.model.transformer import load_flat_params
    from tpu_jobs.rollout_worker import RolloutWorker
    from tpu_jobs.trainer import Trainer

    trainer = Trainer(run, log=lambda m: None, fused=False)
    worker = RolloutWorker(run, "w0", log=lambda m: None)
    load_flat_params(worker.model, base_server(run).pull(0).tensors)
    cfg = run.config
    rows = []
    for dtype in ("bfloat16", "float32"):
        worker.cfg = replace(cfg, sampler=replace(cfg.sampler, dtype=dtype))
        batch = worker.generate_batch(0, 0)
        base_stats = None
        for replay in (False, True):
            lcfg = replace(cfg, trainer=cfg.trainer.replace(routing_replay=replay, kl_coef=0.0))
            learner = Learner(lcfg, trainer.prompt_len, fused=False)
            params, opt = learner.init_state(trainer._base_params())
            if base_stats is None:
                with_routing = replace(lcfg, trainer=lcfg.trainer.replace(routing_replay=True))
                rl = Learner(with_routing, trainer.prompt_len, fused=False)
                base_stats = routing_stats(batch, rl, params)
            inp = learner.inputs(batch)
            fixed = (None, None, inp.routing)
            logp = np.asarray(
                learner.programs.forward(params, inp.tokens, inp.mask, None, *fixed)[0]
            )
            real = inp.comp_mask > 0
            diff = np.abs(logp - inp.logp_behaviour)[real]
            _, _, m = learner.step(params, opt, None, inp)
            rows.append(
                {
                    "model": label,
                    "sampler": dtype,
                    "replay": replay,
                    "completion_tokens": int(real.sum()),
                    "absdiff_mean": float(diff.mean()),
                    "absdiff_max": float(diff.max()),
                    "is_ratio_min": m["is_ratio_min"],
                    "is_ratio_max": m["is_ratio_max"],
                    "ratio_max": m.get("ratio_max"),
                    **base_stats,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _kind(name: str) -> str:
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.gate." in name:
        return "routers"
    return "rest"


def deltas(run: Run, steps: int) -> list[dict]:
    """On-policy GRPO steps; each version's bfloat16 elements against the previous."""
    import ml_dtypes

    from tpu_jobs.learning.step import Learner
    from tpu_jobs.model.state import params_to_flat
    from tpu_jobs.model.transformer import load_flat_params
    from tpu_jobs.rollout_worker import RolloutWorker
    from tpu_jobs.trainer import Trainer

    cfg = run.config
    trainer = Trainer(run, log=lambda m: None, fused=False)
    learner = Learner(cfg, trainer.prompt_len, fused=False)
    params, opt = learner.init_state(trainer._base_params())
    worker = RolloutWorker(run, "w0", log=lambda m: None)
    m = cfg.model

    def bf16(p):
        flat = params_to_flat(learner.fns, p["policy"])
        return {k: v.astype(ml_dtypes.bfloat16).view(np.uint16) for k, v in flat.items()}

    prev = bf16(params)
    rows = []
    for step in range(steps):
        load_flat_params(worker.model, params_to_flat(learner.fns, params["policy"]))
        batch = worker.generate_batch(step, step)
        inp = learner.inputs(batch)
        # Tokens per (layer, expert) this batch sent (the recorded routing of real tokens).
        rec = np.asarray(inp.routing)[np.asarray(inp.mask) > 0]  # [tokens, L, k]
        load = np.stack(
            [np.bincount(rec[:, layer].reshape(-1), minlength=m.num_experts + 1)[:-1]
             for layer in range(m.num_layers)]
        )  # fmt: skip
        params, opt, _ = learner.step(params, opt, None, inp, step=step)
        cur = bf16(params)
        changed = {k: 0 for k in ("experts", "routers", "rest")}
        total = dict(changed)
        idle_changed = []
        for name, arr in cur.items():
            diff = arr != prev[name]
            changed[_kind(name)] += int(diff.sum())
            total[_kind(name)] += arr.size
            if ".mlp.experts." in name:  # [E, in, out]: per expert
                layer = int(name.split(".")[1])
                for e in np.flatnonzero(load[layer] == 0):
                    idle_changed.append(float(diff[e].mean()))
        prev = cur
        row = {
            "step": step + 1,
            "changed_frac": sum(changed.values()) / sum(total.values()),
            **{f"changed_frac_{k}": changed[k] / total[k] for k in changed},
            "idle_experts": int((load == 0).sum()),
            "idle_expert_changed_frac_max": max(idle_changed) if idle_changed else None,
            "expert_tokens_min": int(load.min()),
            "expert_tokens_max": int(load.max()),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def write(args, align: list[dict], delta: list[dict], seconds: float) -> None:
    lines = [
        "# Routing replay and delta versions on the MoE demo model",
        "",
        f"`{' '.join(['python', *sys.argv])}` on {time.strftime('%Y-%m-%d')} "
        f"({platform.machine()}, {platform.system()}; {seconds / 60:.1f} min).",
        "",
        f"`demo_moe` (8 experts, top-2 of 192, 3 layers, hidden 128), configs/demo.yaml's "
        f"arithmetic task and sampling (temperature 1, up to 56 new tokens), seed {args.seed}; "
        f"batch 0 of {args.prompts} prompts x {args.group} samples from the engine "
        "(`sampler.engine=jax`), its routing recorded; the float32 trainer recomputes the "
        "completion tokens' log-probs. `random init`: the preset's initialisation; "
        f"`SFT {args.sft_steps}`: after that many SFT steps (sft.target_loss off).",
        "",
        "## Trainer-sampler alignment, routing replay off and on",
        "",
        "|logp_t - logp_s|: over the completion tokens (the sampler's log-probs against the "
        "trainer's). is_ratio: pi_old / pi_behaviour as the trainer's step logs it. Top-k "
        "differs: the share of (token, layer) pairs whose set of k experts in the sampler's "
        "record differs from the trainer's own float32 routers' (and of tokens with any "
        "layer differing), over the tokens the sampler ran (prompt and completion but the "
        "last token); replay makes the trainer use the record, so it sees none of them.",
        "",
        "| model | sampler | replay | tokens | mean abs diff | max abs diff | is_ratio min | "
        "is_ratio max | top-k differs (token, layer) | top-k differs (token) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in align:
        lines.append(
            f"| {r['model']} | {r['sampler']} | {'on' if r['replay'] else 'off'} | "
            f"{r['completion_tokens']} | {r['absdiff_mean']:.2e} | {r['absdiff_max']:.2e} | "
            f"{r['is_ratio_min']:.6f} | {r['is_ratio_max']:.6f} | "
            f"{100 * r['topk_differs_token_layer']:.2f}% | {100 * r['topk_differs_token']:.2f}% |"
        )
    lines += [
        "",
        "## Delta versions of a MoE run",
        "",
        f"{len(delta)} on-policy GRPO steps from the random initialisation (lr {args.lr}, weight "
        f"decay 0, no warmup, entropy bonus {args.entropy_coef}: the base earns no reward, so "
        "GRPO alone moves nothing; from the SFT 200 model, whose groups all scored 0, 4 steps "
        "changed 0 elements), each version cast to bfloat16 as `paramserver.dtype=bfloat16` "
        "publishes it: the share of elements that differ from the previous version "
        "(a delta version's payload is about that share of a full one), by kind; idle "
        "experts: (layer, expert) pairs the step's batch sent no token to, and the largest "
        "changed share of their weights.",
        "",
        "| step | changed (all) | experts | routers | rest | idle experts | idle experts' "
        "changed share (max) | tokens per expert (min / max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in delta:
        idle = r["idle_expert_changed_frac_max"]
        lines.append(
            f"| {r['step']} | {100 * r['changed_frac']:.1f}% | "
            f"{100 * r['changed_frac_experts']:.1f}% | {100 * r['changed_frac_routers']:.1f}% | "
            f"{100 * r['changed_frac_rest']:.1f}% | {r['idle_experts']} | "
            f"{'-' if idle is None else f'{100 * idle:.1f}%'} | "
            f"{r['expert_tokens_min']} / {r['expert_tokens_max']} |"
        )
    if args.note:
        lines += ["", args.note]
    out = Path(args.out)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(
        json.dumps({"alignment": align, "deltas": delta}, indent=1) + "\n"
    )
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--delta-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=8e-5, help="trainer.lr (the demo's)")
    parser.add_argument("--entropy-coef", type=float, default=0.01)
    parser.add_argument("--deltas-only", action="store_true")
    parser.add_argument("--root", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--note", default="", help="a paragraph for the results file")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or tmp)
        run = make_run(args, root / "random")
        publish_random_base(run)
        if args.deltas_only:
            align = json.loads(Path(args.out).with_suffix(".json").read_text())["alignment"]
        else:
            align = alignment(run, "random init")
        delta = deltas(run, args.delta_steps) if args.delta_steps else []
        if args.sft_steps and not args.deltas_only:
            from tpu_jobs.sft import train_sft

            run = make_run(args, root / "sft")
            train_sft(run)
            align += alignment(run, f"SFT {args.sft_steps}")
    write(args, align, delta, time.time() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
