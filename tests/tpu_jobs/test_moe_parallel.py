"""Expert parallelism (issue 38, item 3): a mixture-of-experts model on meshes with an
`expert` axis of 8 fake CPU devices gives the one-device numbers (an AdamW train step with
the router losses, sampling), each device holding only its experts; and the parameter
server cuts expert kernels along the expert axis, so a host of a 2-way expert split
downloads only its experts.

The 8-device part runs in a subprocess (XLA_FLAGS must be set before jax is imported), as
tests/tpu_jobs/test_mesh.py does for dense models.
"""

from __future__ import annotations

import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from tests.tpu_jobs.test_mesh import BATCH8, run_on_eight_devices
from tpu_jobs.model import mesh as M

pytestmark = pytest.mark.moe

SCRIPT = (
    r"""
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np, optax
from pipeline.config import ModelConfig
from pipeline.paramserver import ParamServer, Snapshot
from pipeline.storage import open_store
from tests.pipeline.test_retention import HookedStore
from tpu_jobs.generate.interface import SamplingParams
from tpu_jobs.generate.static_sampler import StaticSampler
from tpu_jobs.model import mesh as M
from tpu_jobs.model import moe
from tpu_jobs.model.state import split_model
from tpu_jobs.model.transformer import flat_params, init_model

assert jax.device_count() == 8, jax.devices()
# 8 experts, top-2, a shared expert: every kind of MoE parameter.
cfg = ModelConfig(preset="tiny_moe", num_experts=8, qk_norm=True, norm_topk_prob=True,
                  shared_expert_intermediate_size=16, tie_embeddings=False)
fns, params = split_model(init_model(cfg, 0))
"""
    + BATCH8
    + r"""
def loss_fn(params, tokens, mask):
    model = fns.merge(params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    _, router = model.hidden_and_router(tokens, positions, mask)
    aux, metrics = moe.router_loss(router, mask, 0.01, 0.001)
    return -jnp.mean(fns.logprobs(params, tokens, mask)) + aux, (metrics, router.experts)

@jax.jit
def step(params, opt_state, tokens, mask):
    (loss, (metrics, experts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, tokens, mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads, metrics, experts

def train(params, opt_state, tokens, mask):
    losses, grads, metrics, experts = [], [], [], []
    for _ in range(2):
        params, opt_state, loss, g, m, e = step(params, opt_state, tokens, mask)
        losses.append(float(loss))
        grads.append(g)
        metrics.append({k: float(v) for k, v in m.items()})
        experts.append(np.asarray(e))
    return params, losses, grads, metrics, experts

out = {}
ref = train(params, tx.init(params), tokens, mask)
out["grad_max"] = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(ref[2][0]))
out["loss_decreased"] = ref[1][-1] < ref[1][0]
out["experts_used"] = int(len(np.unique(ref[4][0])))
# Each dispatch (model.moe_dispatch; "auto" is "tiled" on CPU, "ragged_dot" on GPU/TPU)
# against its own one-device run; a new jit per dispatch (`fns` is read when tracing).
runs = [("tiled", s) for s in ((2, 2, 1, 2), (1, 2, 2, 2), (1, 1, 1, 8))]
runs.append(("ragged_dot", (1, 2, 2, 2)))
for dispatch, shape in runs:
    if dispatch == "ragged_dot" and "ref_ragged" not in out:
        fns = split_model(init_model(dataclasses.replace(cfg, moe_dispatch=dispatch), 0))[0]
        step = jax.jit(step.__wrapped__)
        ref = train(params, tx.init(params), tokens, mask)
        out["ref_ragged"] = ref[1]
    mesh = M.make_mesh(shape)
    p_sh = M.shard_tree(params, mesh)
    o_sh = M.shard_tree(tx.init(params), mesh)
    t_sh, m_sh = M.shard_batch((tokens, mask), mesh)
    got = train(p_sh, o_sh, t_sh, m_sh)
    kernel = p_sh["layers"][0]["mlp"]["experts"]["gate_proj"]["kernel"][...]
    out[f"{dispatch} {shape}"] = {
        "param_diff": maxdiff(ref[0], got[0]),
        "grad_diff": max(maxdiff(a, b) for a, b in zip(ref[2], got[2])),
        "loss_diff": float(np.abs(np.array(ref[1]) - np.array(got[1])).max()),
        "metric_diff": max(abs(a[k] - b[k]) for a, b in zip(ref[3], got[3]) for k in a),
        "same_experts": all(np.array_equal(a, b) for a, b in zip(ref[4], got[4])),
        "param_specs": M.describe(p_sh),
        # XLA may name an output's sharding differently (size-1 axes left out): the same
        # placement is what must hold.
        "out_same_sharding": all(
            a.sharding.is_equivalent_to(b.sharding, a.ndim)
            for a, b in zip(jax.tree.leaves(p_sh), jax.tree.leaves(got[0]))),
        "opt_specs": M.describe(o_sh),
        "expert_shard_shape": list(kernel.addressable_shards[0].data.shape),
    }

# Sampling on an expert-parallel sampler mesh: the one-device tokens and log-probs.
model = init_model(cfg, 1)
prompts = [[1, *rng.integers(4, 64, n).tolist()] for n in (3, 7, 5, 9, 2, 6, 4, 8)]
keys = jax.random.split(jax.random.key(3), len(prompts))
ref_s = StaticSampler(cfg, eos_id=-1)
for shape in ((4, 1, 1, 2), (1, 1, 1, 8)):
    mesh = M.make_mesh(shape)
    sh_s = StaticSampler(cfg, eos_id=-1, mesh=mesh)
    sharded = M.shard_model(init_model(cfg, 1), mesh)
    params_ = SamplingParams(max_new_tokens=10, temperature=1.0)
    a = ref_s.generate(model, prompts, keys, params_)
    b = sh_s.generate(sharded, prompts, keys, params_)
    out[f"sample {shape}"] = {"tokens_equal": bool(np.array_equal(a.tokens, b.tokens)),
                              "logprob_diff": float(np.abs(a.logprobs - b.logprobs).max())}

# Shard-wise pulls on a 2-way expert split: the host holding device 1 only.
flat = {k: np.asarray(v) for k, v in flat_params(init_model(cfg, 2)).items()}
ep = M.make_mesh((1, 1, 1, 2), jax.devices()[:2])
split = M.split_axes({k: v.shape for k, v in flat.items()}, 2, axis="expert")
store = open_store("memory://expertwise")
writer = ParamServer(store, shard_bytes=1 << 12)
epoch = writer.acquire_epoch()
writer.publish(0, flat, epoch=epoch, split=split, parts=2)
read = []
reader = ParamServer(HookedStore(store, lambda key: read.append(len(store.read(key)))))
ranks = M.tensor_ranks(ep, [ep.devices.flat[1]], axis="expert")
half = reader.pull(0, ranks=ranks)
out["ep_ranks"] = sorted(ranks)
out["ep_all_ranks"] = M.tensor_ranks(ep, axis="expert")
out["ep_split"] = split
out["ep_bytes_read"] = sum(read[1:])  # [0] is the manifest
out["ep_bytes"] = {k: int(v.nbytes) for k, v in flat.items()}
# the piece is what device 1 holds under the sampler's rules
out["ep_pieces_match_device_1"] = all(
    device_piece(ep, n, a, 1) == half.tensors[n].tobytes() for n, a in flat.items())
print("RESULT" + json.dumps(out))
"""
)


def test_expert_rules_split_the_stacked_experts():
    mesh = AbstractMesh((1, 2, 2, 2), M.AXES)

    def spec(name, shape):
        return M.spec_for(name, shape, mesh)

    assert spec("layers.0.mlp.experts.gate_proj.kernel", (8, 32, 16)) == P(
        "expert", "fsdp", "tensor"
    )
    assert spec("layers.0.mlp.experts.down_proj.kernel", (8, 16, 32)) == P(
        "expert", "tensor", "fsdp"
    )
    assert spec("0.mu.layers.1.mlp.experts.up_proj.kernel", (8, 32, 16)) == P(
        "expert", "fsdp", "tensor"
    )
    # 3 experts on 2 expert ranks: replicated over `expert`, still split as an MLP.
    assert spec("layers.0.mlp.experts.up_proj.kernel", (3, 32, 16)) == P(None, "fsdp", "tensor")
    assert spec("layers.0.mlp.gate.kernel", (32, 8)) == P()  # the router: replicated
    assert spec("layers.0.mlp.shared_expert.down_proj.kernel", (16, 32)) == P("tensor", "fsdp")
    # Dense parameters never name the expert axis.
    assert spec("layers.0.self_attn.q_proj.kernel", (32, 32)) == P("fsdp", "tensor")
    assert M.resolve_shape((1, 2, 2), 8) == (1, 2, 2, 1)  # 3 entries: expert = 1
    assert M.resolve_shape((1, 2, 1, -1), 8) == (1, 2, 1, 4)
    assert M.batch_size_multiple(mesh) == 4  # data x fsdp x expert
    with pytest.raises(ValueError, match="or 3, expert = 1"):
        M.resolve_shape((1, 2), 8)


@pytest.fixture(scope="module")
def eight_devices() -> dict:
    return run_on_eight_devices(SCRIPT)


@pytest.mark.parametrize(
    "dispatch, shape",
    [
        ("tiled", "(2, 2, 1, 2)"),
        ("tiled", "(1, 2, 2, 2)"),
        ("tiled", "(1, 1, 1, 8)"),
        ("ragged_dot", "(1, 2, 2, 2)"),
    ],
)
def test_moe_train_step_with_expert_parallelism_matches_one_device(eight_devices, dispatch, shape):
    r, got = eight_devices, eight_devices[f"{dispatch} {shape}"]
    assert r["loss_decreased"] and r["experts_used"] == 8 and r["grad_max"] > 1e-2
    assert got["same_experts"]  # every token routed as on one device, both steps
    assert got["loss_diff"] <= 1e-5 and got["metric_diff"] <= 1e-5
    assert got["grad_diff"] <= 1e-6  # the reduction order of sharded sums only
    assert got["param_diff"] <= 1e-5  # (test_mesh.py says why Adam allows 1e-5)
    specs = got["param_specs"]
    assert got["out_same_sharding"]  # the update keeps every parameter's placement
    expert = str(
        M.spec_for(
            "layers.0.mlp.experts.gate_proj.kernel",
            (8, 32, 16),
            AbstractMesh(tuple(int(s) for s in shape.strip("()").split(", ")), M.AXES),
        )
    )
    assert specs["layers.0.mlp.experts.gate_proj.kernel"] == expert
    assert got["opt_specs"]["0.mu.layers.0.mlp.experts.gate_proj.kernel"] == expert
    e = int(shape.strip("()").split(", ")[3])
    assert got["expert_shard_shape"][0] == 8 // e  # a device holds only its experts


@pytest.mark.parametrize("shape", ["(4, 1, 1, 2)", "(1, 1, 1, 8)"])
def test_sampling_with_expert_parallelism_matches_one_device(eight_devices, shape):
    got = eight_devices[f"sample {shape}"]
    assert got["tokens_equal"] and got["logprob_diff"] <= 1e-5, got


def test_expert_wise_pull_reads_only_this_hosts_experts(eight_devices):
    """A host whose device holds expert rank 1 of a (1, 1, 1, 2) sampler mesh downloads
    half of each expert kernel (experts 4..7) and every other tensor whole: the bytes read
    against the store are that sum, counted by hand from the tensors' sizes."""
    r = eight_devices
    assert r["ep_ranks"] == [1] and r["ep_all_ranks"] is None  # one process holds both
    split, sizes = r["ep_split"], r["ep_bytes"]
    experts = [k for k in sizes if ".mlp.experts." in k]
    assert len(experts) == 3 * 2  # gate/up/down of 2 layers
    assert all(split[k] == 0 for k in experts)  # cut along E
    assert all(split[k] is None for k in sizes if k not in experts)  # whole
    want = sum(sizes[k] // 2 for k in experts) + sum(sizes[k] for k in sizes if k not in experts)
    total = sum(sizes.values())
    # The store also holds shard framing: within 2% of the hand count, well below the total.
    assert want <= r["ep_bytes_read"] <= 1.02 * want, (r["ep_bytes_read"], want, total)
    assert r["ep_bytes_read"] < total - sum(sizes[k] for k in experts) // 2 * 0.98
    assert r["ep_pieces_match_device_1"]


def test_mesh_config_expert_axis_and_the_parameter_servers_pieces():
    from pipeline.config import load_config
    from pipeline.errors import ConfigError

    cfg = load_config(None, ["mesh.trainer=[1,2,1,4]", "mesh.sampler=[-1,1,1,2]"])
    assert cfg.mesh.trainer == (1, 2, 1, 4)
    assert cfg.paramserver.parts(cfg.mesh.sampler) == 2  # one piece per expert rank
    assert load_config(None, ["mesh.sampler=[-1,1,2]"]).paramserver.parts((-1, 1, 2)) == 2
    assert load_config(None).paramserver.parts(None) == 1
    with pytest.raises(ConfigError, match="tensor or expert > 1, not both"):
        load_config(None, ["mesh.sampler=[1,1,2,2]"])
    with pytest.raises(ConfigError, match="0 or the expert size of mesh.sampler"):
        load_config(None, ["mesh.sampler=[-1,1,1,2]", "paramserver.tensor_parts=4"])
