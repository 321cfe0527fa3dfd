"""Mixture-of-experts models (issue 38, items 1-2): dropless dispatch against a dense
reference that runs every expert (values and gradients), routing and the router losses
against NumPy and transformers' `load_balancing_loss_func`, Qwen3-MoE logit parity with
`transformers` both ways, the model's other paths (remat scan, chunked attention, bf16,
KV-cache decode, flat params), a trainer step and the engine on a MoE preset."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.config import MOE_DISPATCH, ModelConfig
from pipeline.errors import ConfigError
from tests.runs import tiny_config
from tpu_jobs.learning.step import Learner, StepInputs
from tpu_jobs.model import moe
from tpu_jobs.model.transformer import (
    flat_params,
    init_model,
    load_flat_params,
    param_count,
    positions_from_mask,
)

pytestmark = pytest.mark.moe  # the `moe` lane of .ci/run (make test stays < 12 min)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.tpu_jobs.test_hf import (  # noqa: E402
    COMMON,
    MASK,
    TOKENS,
    build_hf,
    hf_logits,
    our_logits,
)
from tests.tpu_jobs.test_sampler import check_logprobs  # noqa: E402
from tpu_jobs.generate.engine import Engine  # noqa: E402
from tpu_jobs.generate.interface import SamplingParams  # noqa: E402
from tpu_jobs.generate.static_sampler import StaticSampler  # noqa: E402
from tpu_jobs.model import hf_checkpoint  # noqa: E402

E, K, H, INTER, N = 6, 2, 8, 5, 40


# --------------------------------------------------------------------------- references


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    probs = np_softmax(logits.astype(np.float64))
    experts = np.argsort(-probs, axis=-1, kind="stable")[..., :k]
    weights = np.take_along_axis(probs, experts, -1)
    if norm:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def dense_reference(x, experts, weights, w_gate, w_up, w_down):
    """Every expert on every token, combined through a [N, E] weight matrix that is zero
    where the expert was not picked: no sorting, no grouping."""
    combine = jnp.sum(
        jax.nn.one_hot(experts, w_gate.shape[0], dtype=x.dtype) * weights[..., None], axis=1
    )
    gate = jnp.einsum("nh,ehi->nei", x, w_gate)
    up = jnp.einsum("nh,ehi->nei", x, w_up)
    out = jnp.einsum("nei,eih->neh", jax.nn.silu(gate) * up, w_down)
    return jnp.einsum("neh,ne->nh", out, combine)


def np_aux_and_z(logits, experts, mask, num_experts):
    """Switch load balancing (as transformers) and the ST-MoE z-loss over the real tokens
    of every layer, in float64 loops."""
    counts, probs, z_sq, total = np.zeros(num_experts), np.zeros(num_experts), 0.0, 0
    for layer, b, t in np.ndindex(logits.shape[:3]):
        if not mask[b, t]:
            continue
        lg = logits[layer, b, t].astype(np.float64)
        for e in experts[layer, b, t]:
            counts[e] += 1
        probs += np_softmax(lg)
        z_sq += (lg.max() + np.log(np.exp(lg - lg.max()).sum())) ** 2
        total += 1
    return num_experts * np.sum((counts / total) * (probs / total)), z_sq / total


@pytest.fixture(scope="module")
def tensors():
    rng = np.random.default_rng(0)
    f = np.float32
    return dict(
        x=rng.standard_normal((N, H)).astype(f),
        logits=(1.5 * rng.standard_normal((N, E))).astype(f),
        w_gate=(0.5 * rng.standard_normal((E, H, INTER))).astype(f),
        w_up=(0.5 * rng.standard_normal((E, H, INTER))).astype(f),
        w_down=(0.5 * rng.standard_normal((E, INTER, H))).astype(f),
    )


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("norm", [False, True])
def test_route_is_the_top_k_of_the_softmax(tensors, norm):
    weights, experts = moe.route(jnp.asarray(tensors["logits"]), K, norm)
    ref_w, ref_e = np_route(tensors["logits"], K, norm)
    np.testing.assert_array_equal(np.asarray(experts), ref_e)
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-6, atol=1e-7)
    # Replay: given experts are used as they are, weighted by the router's probabilities.
    given = np.stack([np.arange(N) % E, (np.arange(N) + 3) % E], axis=1)
    w2, e2 = moe.route(jnp.asarray(tensors["logits"]), K, norm, jnp.asarray(given))
    probs = np_softmax(tensors["logits"].astype(np.float64))
    ref = np.take_along_axis(probs, given, -1)
    ref = ref / ref.sum(-1, keepdims=True) if norm else ref
    np.testing.assert_array_equal(np.asarray(e2), given)
    np.testing.assert_allclose(np.asarray(w2), ref, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("dispatch", sorted(moe.DISPATCH))
def test_dropless_dispatch_equals_the_dense_reference_values_and_gradients(tensors, dispatch):
    t = {k: jnp.asarray(v) for k, v in tensors.items()}
    # Skewed routing: expert 0 gets most tokens, expert E-1 none (a capacity factor would
    # drop tokens here; dropless must not).
    logits = t["logits"].at[:, 0].add(3.0).at[:, E - 1].add(-30.0)

    def loss(fn, x, logits, w_gate, w_up, w_down):
        weights, experts = moe.route(logits, K, True)
        y = fn(x, experts, weights, w_gate, w_up, w_down)
        return jnp.sum(jnp.sin(y)), y  # a non-linear readout: every output matters

    args = (t["x"], logits, t["w_gate"], t["w_up"], t["w_down"])
    grad = jax.grad(loss, argnums=(1, 2, 3, 4, 5), has_aux=True)
    g_ours, y_ours = jax.jit(lambda *a: grad(moe.DISPATCH[dispatch], *a))(*args)
    g_ref, y_ref = jax.jit(lambda *a: grad(dense_reference, *a))(*args)
    _, experts = moe.route(logits, K, True)
    counts = np.bincount(np.asarray(experts).reshape(-1), minlength=E)
    assert counts[0] > N * K / E and counts[E - 1] == 0  # skewed, one expert idle
    np.testing.assert_allclose(np.asarray(y_ours), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("x", "logits", "gate", "up", "down"), g_ours, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=name)
        assert np.abs(np.asarray(b)).max() > 1e-3, name  # a gradient that exists
    assert np.all(np.asarray(g_ours[4])[E - 1] == 0)  # the idle expert gets no gradient


def test_tiled_experts_in_blocks_equal_the_dense_reference(tensors, monkeypatch):
    """Past `TILE_KERNEL_BYTES` of gathered kernels the tiles run in blocks (a lax.map,
    each block recomputed in the backward pass): the same values and gradients."""
    t = {k: jnp.asarray(v) for k, v in tensors.items()}
    per_tile = 4 * (2 * H * INTER + INTER * H)  # the three float32 kernels of one expert
    monkeypatch.setattr(moe, "TILE_KERNEL_BYTES", 3 * per_tile)  # blocks of 3 tiles

    def loss(fn, x, logits, w_gate, w_up, w_down):
        weights, experts = moe.route(logits, K, True)
        return jnp.sum(jnp.sin(fn(x, experts, weights, w_gate, w_up, w_down)))

    args = (t["x"], t["logits"], t["w_gate"], t["w_up"], t["w_down"])
    grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))
    (v_ours, g_ours), (v_ref, g_ref) = grad(moe.tiled_experts, *args), grad(dense_reference, *args)
    tiles = (N * K + E * (moe.dispatch_tile(N * K, E) - 1)) // moe.dispatch_tile(N * K, E)
    assert tiles > 3 and tiles % 3  # several blocks and a remainder
    np.testing.assert_allclose(float(v_ours), float(v_ref), rtol=1e-5)
    for name, a, b in zip(("x", "logits", "gate", "up", "down"), g_ours, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("dispatch", sorted(moe.DISPATCH))
def test_an_expert_held_elsewhere_adds_nothing(tensors, dispatch):
    """Under expert parallelism a device runs only the experts it holds: the others'
    assignments come with the id E_held (one past its last), and the dispatch must give
    exactly the dense reference over the held experts, the others left out."""
    t = {k: jnp.asarray(v) for k, v in tensors.items()}
    weights, experts = moe.route(t["logits"], K, True)
    held = E // 2  # this device holds experts 0 .. held - 1
    local = jnp.where(experts < held, experts, held)
    kernels = (t["w_gate"][:held], t["w_up"][:held], t["w_down"][:held])
    got = moe.DISPATCH[dispatch](t["x"], local, weights, *kernels)
    # The reference: every expert, with the weights of the ones not held set to 0.
    ref = dense_reference(t["x"], experts, jnp.where(experts < held, weights, 0.0),
                          t["w_gate"], t["w_up"], t["w_down"])  # fmt: skip
    assert 0 < int(jnp.sum(experts >= held)) < N * K  # some held here, some not
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


EP_SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from tests.tpu_jobs.test_moe import dense_reference
from tpu_jobs.model import mesh as M
from tpu_jobs.model import moe

rng = np.random.default_rng(0)
N, H, I, E, K = 64, 16, 8, 8, 2
x = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]), jnp.int32)
weights = jnp.asarray(rng.random((N, K)), jnp.float32)
kernels = [jnp.asarray(0.5 * rng.standard_normal(s), jnp.float32)
           for s in ((E, H, I), (E, H, I), (E, I, H))]

def loss(fn, x, weights, *kernels):
    return jnp.sum(jnp.sin(fn(x, experts, weights, *kernels)))

args = (x, weights, *kernels)
grad = jax.grad(loss, argnums=(1, 2, 3, 4, 5))
ref_y = dense_reference(x, experts, weights, *kernels)
ref_g = grad(dense_reference, *args)
out = {}
for name, fn in moe.DISPATCH.items():
    # (data, fsdp, tensor, expert): tokens over expert only, over all four, experts whole
    # on every device (expert 1), 8 tokens that do not split over 16 ranks.
    for shape in ((1, 1, 1, 8), (1, 2, 2, 2), (2, 2, 2, 1), (1, 1, 2, 4)):
        mesh = M.make_mesh(shape)
        with jax.set_mesh(mesh):
            ep = lambda *a: moe.expert_parallel(fn, jax.sharding.get_abstract_mesh(), *a)
            y = jax.jit(ep)(x, experts, weights, *kernels)
            g = jax.jit(lambda *a: grad(ep, *a))(*args)
            hlo = jax.jit(ep).lower(x, experts, weights, *kernels).as_text()
        out[f"{name} {shape}"] = {
            "y": float(jnp.abs(y - ref_y).max() / jnp.abs(ref_y).max()),
            "g": max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(g, ref_g)),
            "manual": "manual_computation" in hlo or "SPMDFullToShardShape" in hlo,
        }
print("RESULT" + json.dumps(out))
"""


@pytest.mark.moe
def test_expert_parallel_dispatch_equals_the_dense_reference_on_eight_devices():
    """`moe.expert_parallel` on 8 fake CPU devices, each dispatch, on meshes that split
    the tokens and the experts differently: the dense reference's values and gradients
    (to float32 sum order), through a per-device (shard_map) program."""
    from tests.tpu_jobs.test_mesh import run_on_eight_devices

    out = run_on_eight_devices(EP_SCRIPT)
    assert len(out) == 2 * 4
    for case, r in out.items():
        assert r["manual"], case
        assert r["y"] <= 1e-6 and r["g"] <= 1e-4, (case, r)


def test_dispatch_names_and_tiles():
    """The config's names are the registry's; "auto" takes the tiled experts on CPU only;
    tiles are about an expert's even share of the assignments, a power of 2 in [8, 128]."""
    assert set(MOE_DISPATCH) == {"auto", *moe.DISPATCH}
    assert moe.dispatch("auto", "cpu") is moe.tiled_experts
    assert moe.dispatch("auto", "tpu") is moe.dropless_experts
    assert moe.dispatch("ragged_dot", "cpu") is moe.dropless_experts
    expected = {(4096, 8): 128, (1000, 8): 128, (256, 8): 32, (130, 8): 16, (16, 8): 8, (1, 8): 8}
    assert {a: moe.dispatch_tile(*a) for a in expected} == expected


# --------------------------------------------------------------------------- losses


def test_router_losses_and_metrics_against_numpy_and_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(3)
    layers, b, t = 3, 2, 7
    logits = (2 * rng.standard_normal((layers, b, t, E))).astype(np.float32)
    mask = np.ones((b, t), np.int32)
    mask[1, :3] = 0
    _, experts = moe.route(jnp.asarray(logits), K, False)
    router = moe.RouterOutputs(jnp.asarray(logits), experts)
    ref_aux, ref_z = np_aux_and_z(logits, np.asarray(experts), mask, E)
    aux = float(moe.load_balancing_loss(router, jnp.asarray(mask)))
    z = float(moe.router_z_loss(router, jnp.asarray(mask)))
    assert aux == pytest.approx(ref_aux, rel=1e-5) and z == pytest.approx(ref_z, rel=1e-5)
    # transformers' own function on the same logits (one [B*T, E] tensor per layer).
    per_layer = tuple(torch.tensor(logits[i].reshape(b * t, E)) for i in range(layers))
    hf_masked = load_balancing_loss_func(per_layer, E, K, torch.tensor(mask))
    hf_all = load_balancing_loss_func(per_layer, E, K)
    assert aux == pytest.approx(float(hf_masked), rel=1e-5)
    assert float(moe.load_balancing_loss(router)) == pytest.approx(float(hf_all), rel=1e-5)
    # Expert load: max / mean and min / mean assignments per layer; router entropy.
    m = {k: float(v) for k, v in moe.expert_load_metrics(router, jnp.asarray(mask)).items()}
    loads = np.zeros((layers, E))
    for layer in range(layers):
        for e in np.asarray(experts)[layer][mask > 0].reshape(-1):
            loads[layer, e] += 1
    ratio = loads / loads.mean(-1, keepdims=True)
    p = np_softmax(logits.astype(np.float64))
    ent = -(p * np.log(p)).sum(-1)
    assert m["expert_load_max"] == pytest.approx(ratio.max(-1).max(), rel=1e-6)
    assert m["expert_load_min"] == pytest.approx(ratio.min(-1).min(), rel=1e-6)
    assert m["router_entropy"] == pytest.approx(ent[:, mask > 0].mean(), rel=1e-5)
    value, metrics = moe.router_loss(router, jnp.asarray(mask), 0.01, 0.001)
    assert float(value) == pytest.approx(0.01 * ref_aux + 0.001 * ref_z, rel=1e-5)
    assert set(metrics) == {"router_aux_loss", "router_z_loss", *m}


# --------------------------------------------------------------------------- model paths

MOE_CFG = ModelConfig(preset="tiny_moe", vocab_size=64, qk_norm=True, norm_topk_prob=True)


def _random_moe(cfg: ModelConfig, seed: int = 0):
    """A model whose routers are far from uniform (the init's 0.02 gives near-ties)."""
    model = init_model(cfg, seed)
    flat = flat_params(model)
    rng = np.random.default_rng(seed)
    for name in flat:
        if name.endswith("mlp.gate.kernel"):
            flat[name] = rng.standard_normal(flat[name].shape).astype(np.float32)
    load_flat_params(model, flat)
    return model


def _hidden_and_router(model, tokens, mask, **kw):
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    return model.hidden_and_router(tokens, positions_from_mask(mask), mask, **kw)


def test_model_paths_agree_and_routing_replays():
    tokens = np.random.default_rng(1).integers(3, 64, (3, 16))
    mask = np.ones_like(tokens)
    mask[1, :5] = 0
    real = mask.astype(bool)
    model = _random_moe(MOE_CFG)
    assert param_count(MOE_CFG) == sum(v.size for v in flat_params(model).values())
    ref, router = _hidden_and_router(model, tokens, mask)
    assert router.logits.shape == (2, 3, 16, 4) and router.experts.shape == (2, 3, 16, 2)
    assert len(np.unique(np.asarray(router.experts)[:, real])) == 4  # every expert used
    plain, _ = model.hidden(jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), mask)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(ref))
    # Replaying the forward's own choices is the same forward.
    replay, _ = _hidden_and_router(model, tokens, mask, routing=router.experts)
    np.testing.assert_array_equal(np.asarray(replay), np.asarray(ref))
    # Replaying other experts changes the output (the seam is live).
    other, _ = _hidden_and_router(model, tokens, mask, routing=(router.experts + 1) % 4)
    assert np.abs(np.asarray(other) - np.asarray(ref))[real].max() > 1e-2
    flat = flat_params(model)
    for changes in (dict(remat="full"), dict(remat="dots"), dict(attention="chunked",
                    attention_chunk=4)):  # fmt: skip
        variant = init_model(replace(MOE_CFG, **changes), 0)
        load_flat_params(variant, flat)
        h, r = _hidden_and_router(variant, tokens, mask)
        np.testing.assert_allclose(np.asarray(h)[real], np.asarray(ref)[real], atol=2e-5)
        np.testing.assert_array_equal(np.asarray(r.experts), np.asarray(router.experts))
    bf16, _ = _hidden_and_router(model, tokens, mask, dtype="bfloat16")
    err = np.abs(np.asarray(bf16, np.float32) - np.asarray(ref))[real]
    assert err.mean() < 0.05 * np.abs(np.asarray(ref)[real]).mean()  # bf16's few bits


def test_configuration_errors():
    with pytest.raises(
        ConfigError, match=r"model.num_experts_per_tok=5 is invalid; allowed: 1..num"
    ):
        ModelConfig(preset="tiny_moe", num_experts_per_tok=5)
    with pytest.raises(ConfigError, match="lora.targets=.*attention projections only"):
        tiny_config("model.preset=tiny_moe", "lora.rank=4")
    assert tiny_config("model.preset=tiny_moe", "lora.rank=4", "lora.targets=[q, v]").lora.rank
    model = init_model(ModelConfig(), 0)
    with pytest.raises(ValueError, match="routing= is for mixture-of-experts models"):
        model.hidden_and_router(*(jnp.ones((1, 3), jnp.int32),) * 3, routing=jnp.zeros(1))
    with pytest.raises(hf_checkpoint.HFError, match="cannot export as Qwen3MoeForCausalLM"):
        hf_checkpoint.hf_config_from_model(replace(MOE_CFG, shared_expert_intermediate_size=8))


def test_shared_expert_adds_an_mlp_every_token_goes_through():
    cfg = replace(MOE_CFG, shared_expert_intermediate_size=16)
    model = _random_moe(cfg)
    flat = flat_params(model)
    assert flat["layers.0.mlp.shared_expert.up_proj.kernel"].shape == (32, 16)
    assert param_count(cfg) == sum(v.size for v in flat.values())
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 32)), jnp.float32)
    layer = model.layers[0].mlp
    y, router = layer(x)
    sh = {k: flat[f"layers.0.mlp.shared_expert.{k}_proj.kernel"] for k in ("gate", "up", "down")}
    xn = np.asarray(x, np.float64)
    g, u = xn @ sh["gate"], xn @ sh["up"]
    shared = (g / (1 + np.exp(-g)) * u) @ sh["down"]
    routed = dense_reference(
        x.reshape(10, 32),
        router.experts.reshape(10, 2),
        moe.route(router.logits, 2, True)[0].reshape(10, 2),
        *(flat[f"layers.0.mlp.experts.{k}_proj.kernel"] for k in ("gate", "up", "down")),
    )
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(routed).reshape(2, 5, 32) + shared, atol=1e-5
    )


# --------------------------------------------------------------------------- Qwen3-MoE

QWEN3_MOE = (
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    dict(head_dim=16, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
         moe_intermediate_size=24, norm_topk_prob=True),
)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    model = build_hf(QWEN3_MOE)
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return model, path


def test_qwen3_moe_import_matches_transformers(qwen3_moe):
    hf_model, path = qwen3_moe
    model, cfg = hf_checkpoint.load_hf_model(path)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 24)
    assert (
        cfg.norm_topk_prob and cfg.qk_norm and cfg.intermediate_size == COMMON["intermediate_size"]
    )
    ref, ours = hf_logits(hf_model, TOKENS, MASK), our_logits(model, TOKENS, MASK)
    diff = np.abs(ours - ref)[MASK.astype(bool)].max()
    print(f"Qwen3-MoE import: max |logit diff| {diff:.2e}")
    assert diff <= 1e-4 and np.abs(ref).max() > 0.5
    # transformers 5 holds the experts fused in memory (gate_up_proj); the same weights.
    in_memory = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory
    fused = hf_checkpoint.hf_to_flat(in_memory, cfg)
    flat = flat_params(model)
    assert fused.keys() == flat.keys()
    assert all(np.array_equal(fused[k], flat[k]) for k in flat)
    # Greedy decoding through the KV cache (the samplers' decode path) as transformers.
    prompts = [[1, 5, 9, 17], [1, 40, 41, 42, 43, 44, 45, 46], [1, 7]]
    width = max(map(len, prompts))
    ids = np.array([[0] * (width - len(p)) + p for p in prompts])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=16,
            do_sample=False, pad_token_id=0,
        )[:, width:].numpy()  # fmt: skip
    sampler = StaticSampler(cfg, pad_id=0, eos_id=-1)
    assert sampler.decode_layout == "token_major"
    keys = jax.random.split(jax.random.key(0), 3)
    out = sampler.generate(model, prompts, keys, SamplingParams(max_new_tokens=16, temperature=0.0))
    np.testing.assert_array_equal(out.tokens, expected)


def test_qwen3_moe_export_reloads_in_transformers(qwen3_moe, tmp_path):
    _, path = qwen3_moe
    model, cfg = hf_checkpoint.load_hf_model(path)
    rng = np.random.default_rng(1)  # change every weight so nothing is read from `path`
    flat = {
        k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
        for k, v in flat_params(model).items()
    }
    hf_checkpoint.export_hf(tmp_path / "out", cfg, flat)
    names = hf_checkpoint.load_hf_tensors(tmp_path / "out")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names  # the Hub's layout
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    assert reloaded.config.norm_topk_prob and reloaded.config.num_experts == 4
    load_flat_params(model, flat)
    ref = hf_logits(reloaded, TOKENS, MASK)
    diff = np.abs(our_logits(model, TOKENS, MASK) - ref)[MASK.astype(bool)].max()
    print(f"Qwen3-MoE export: max |logit diff| {diff:.2e}")
    assert diff <= 1e-4
    cfg2, flat2 = hf_checkpoint.load_hf_checkpoint(tmp_path / "out")  # and back: bit-identical
    assert cfg2 == cfg
    assert flat.keys() == flat2.keys() and all(np.array_equal(flat[k], flat2[k]) for k in flat)


# --------------------------------------------------------------------------- trainer, engine


def _step_inputs(learner: Learner, seed: int) -> StepInputs:
    rng = np.random.default_rng(seed)
    rows, p, c = learner.rows, learner.prompt_len, learner.completion_len
    tokens = rng.integers(3, 40, (rows, p + c)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[::2, : p // 2] = 0  # left-padded prompts
    comp = np.ones((rows, c), np.float32)
    logp_b = np.full((rows, c), -3.0, np.float32)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    return StepInputs(tokens, mask, comp, logp_b, rewards)


def _router_kernels(params) -> list[np.ndarray]:
    """Every layer's router kernel (`layers.{i}.mlp.gate.kernel`) of the train params."""
    leaves = jax.tree_util.tree_flatten_with_path(params["policy"])[0]
    names = {jax.tree_util.keystr(path): np.asarray(v) for path, v in leaves}
    found = [v for n, v in sorted(names.items()) if "'mlp']['gate']" in n]
    assert len(found) == 2, sorted(names)
    return found


def test_trainer_step_adds_the_router_losses_and_logs_expert_load():
    coefs = ("model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001")
    base = ("model.preset=tiny_moe", "rollout.prompts_per_batch=2", "rollout.group_size=2",
            "trainer.kl_coef=0")  # fmt: skip
    steps = {}
    for name, extra in (("off", ()), ("on", coefs)):
        learner = Learner(tiny_config(*base, *extra), 6, fused=False)
        params, opt = learner.init_state(learner.new_policy(0))
        before = _router_kernels(params)
        params, _, metrics = learner.step(params, opt, None, _step_inputs(learner, 0))
        after = _router_kernels(params)
        assert all(np.abs(a - b).max() > 0 for a, b in zip(after, before, strict=True)), name
        steps[name] = metrics
    on, off = steps["on"], steps["off"]
    for key in ("router_aux_loss", "router_z_loss", "expert_load_max", "expert_load_min",
                "router_entropy"):  # fmt: skip
        assert np.isfinite(on[key]) and on[key] == pytest.approx(off[key], rel=1e-6), key
    assert 1.0 <= on["expert_load_max"] <= 4 / 2 and on["router_entropy"] <= np.log(4) + 1e-6
    assert on["router_aux_loss"] >= 2 - 1e-4  # k at a perfect balance, more otherwise
    added = 0.01 * on["router_aux_loss"] + 0.001 * on["router_z_loss"]
    assert on["loss"] - off["loss"] == pytest.approx(added, rel=1e-4, abs=1e-7)


def test_engine_samples_a_moe_model_as_the_static_sampler():
    cfg = replace(MOE_CFG, vocab_size=64)
    model = _random_moe(cfg, seed=3)
    prompts = [[1, 5, 9, 13, 4], [1, 7], [1, 20, 30, 40, 50, 60, 21]]
    keys = jax.random.split(jax.random.key(5), len(prompts))
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    static = StaticSampler(cfg, pad_id=0, eos_id=2).generate(model, prompts, keys, params)
    engine = Engine(cfg, pad_id=0, eos_id=2, max_slots=4, row_buckets=(4,), kv_tokens=64,
                    page_size=4, chunk=4, prompt_buckets=(16,))  # fmt: skip
    out = engine.generate(model, prompts, keys, params)
    np.testing.assert_array_equal(out.tokens, static.tokens)
    check_logprobs(model, prompts, out, 1.0)
