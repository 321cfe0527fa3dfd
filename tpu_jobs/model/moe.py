"""Mixture-of-experts math as pure functions: routing, dropless dispatch, router losses.

A MoE layer (`tpu_jobs.model.transformer.MoE`, Qwen3-MoE's `Qwen3MoeSparseMoeBlock`) sends
each token to `k` of `E` SwiGLU experts picked by a softmax router and sums their outputs
weighted by the router's probabilities (renormalised over the k picked when
`norm_topk_prob`).

Dispatch is dropless: the N * k (token, expert) assignments are sorted by expert and each
expert's contiguous run of rows is multiplied by its own weights with one grouped matmul
(`jax.lax.ragged_dot`), so every token reaches every expert it picked whatever the load,
with no capacity factor and no padding to E equal groups. The work is that of the k active
experts per token, not of all E.

Under a mesh (`expert_parallel`) each device sorts and runs only the assignments of its own
tokens to its own experts: the tokens are gathered over the `expert` axis, each device
multiplies the rows routed to the E / expert experts it holds, and the partial outputs are
reduce-scattered back to their tokens' devices. Nothing of the dispatch is ever the whole
batch's, so its buffers shrink with the mesh (benchmarks/results/memory.md, the
Qwen3-30B-A3B row).

Routing replay (issue 38, item 4) enters through `route(..., experts=)`: given recorded
expert ids, the router's choice is skipped and the weights are the router's probabilities
at those ids, so the router logits still get their gradient through the recorded experts'
weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tpu_jobs.model.mesh import BATCH_AXES, fit_spec, spec_for


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RouterOutputs:
    """What the routers of a forward decided, per MoE layer (stacked on axis 0).

    logits: [layers, B, T, E] float32 router logits (the aux losses and metrics read them);
    experts: [layers, B, T, k] int32, the experts each token was sent to (what routing
    replay records and feeds back as `Transformer.hidden(..., routing=)`)."""

    logits: jax.Array
    experts: jax.Array


def route(
    logits: jax.Array, k: int, norm_topk_prob: bool, experts: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(weights [..., k] float32, experts [..., k] int32) of router logits [..., E].

    The top-k of softmax(logits) (ties to the lower index, as `jax.lax.top_k`), or the
    given `experts` (routing replay); the weights are the softmax probabilities of the
    chosen experts, divided by their sum when `norm_topk_prob` (Qwen3-MoE).

    A token whose given experts are not all < E (the not-recorded mark,
    `pipeline.rollouts.routing_dtype`: the sampler never ran it, as a completion's last
    token, or its row was made without recording) takes the router's own top-k, so a
    partly recorded batch replays what was recorded and routes the rest."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    _, own = jax.lax.top_k(probs, k)
    if experts is not None:
        recorded = jnp.all(experts < logits.shape[-1], axis=-1, keepdims=True)
        own = jnp.where(recorded, experts.astype(jnp.int32), own)
    experts = own.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def dropless_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """sum_j weights[n, j] * SwiGLU_{experts[n, j]}(x[n]) for tokens x [N, H].

    experts, weights: [N, k]; w_gate, w_up: [E, H, I]; w_down: [E, I, H] (each expert's
    kernels [in, out]). The N * k assignments are sorted by expert (stable, so the rows of
    one expert keep token order) and run as grouped matmuls over the E runs; the outputs
    are gathered back and summed per token. Returns [N, H] in x's dtype.

    An expert id of E (an expert another device holds, `expert_parallel`)
    sorts after every real one, outside every group: `ragged_dot` leaves its rows zero,
    so it adds nothing and costs no matmul."""
    order, sizes = _sort_by_expert(experts, w_gate.shape[0])
    layout = _Layout.of(order, jnp.arange(order.size), experts.shape, order.size)
    rows = _to_rows(x, layout)  # [N * k, H], grouped by expert
    gate = jax.lax.ragged_dot(rows, w_gate.astype(x.dtype), sizes)
    up = jax.lax.ragged_dot(rows, w_up.astype(x.dtype), sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down.astype(x.dtype), sizes)
    return _from_rows(out, weights, layout)


def _sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order, sizes) of the [N, k] assignments: `order` sorts their flat index (token * k
    + pick) by expert (stable: one expert's rows keep token order), `sizes` [E] int32 the
    assignments per expert (an id of E, not held here, sorts last and is in no size)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, sizes


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _Layout:
    """Where the [N, k] (token, pick) assignments sit among a dispatch's R rows, both ways:
    `row_assignment` [R] each row's assignment, as its flat index token * k + pick (N * k
    for a row that holds none: padding, or an expert held elsewhere), and `token_rows`
    [N, k] each assignment's row (R for none). With both maps every move between tokens
    and rows, forward and backward, is a gather: no scatter-add of [R, H] rows (XLA:CPU
    expands those into several more buffers of that size) and no order-dependent sums."""

    row_assignment: jax.Array
    token_rows: jax.Array

    @staticmethod
    def of(order, slot, shape: tuple[int, int], num_rows: int) -> _Layout:
        """The layout of the assignments sorted by `order` (their flat index) placed at rows
        `slot` (>= num_rows: dropped)."""
        n, k = shape
        none = jnp.full((num_rows,), n * k, jnp.int32)
        row_assignment = none.at[slot].set(order.astype(jnp.int32), mode="drop")
        slot = jnp.minimum(slot, num_rows).astype(jnp.int32)
        token_rows = jnp.zeros((n * k,), jnp.int32).at[order].set(slot).reshape(n, k)
        return _Layout(row_assignment, token_rows)

    @property
    def row_token(self) -> jax.Array:
        """[R] each row's token (N for none)."""
        return self.row_assignment // self.token_rows.shape[1]


def _rows_of(a: jax.Array, index: jax.Array) -> jax.Array:
    """a[index] along axis 0, zeros where index is out of range (the 'none' marks)."""
    return a.at[index].get(mode="fill", fill_value=0)


@jax.custom_vjp
def _to_rows(x: jax.Array, layout: _Layout) -> jax.Array:
    """[R, H]: each row its token's hidden state (zeros for rows that hold none)."""
    return _rows_of(x, layout.row_token)


def _to_rows_fwd(x, layout):
    return _to_rows(x, layout), layout


def _to_rows_bwd(layout, g):
    # A token's gradient is the sum of its k rows' (none: zero), gathered.
    dx = sum(_rows_of(g, layout.token_rows[:, j]) for j in range(layout.token_rows.shape[1]))
    return dx, None


_to_rows.defvjp(_to_rows_fwd, _to_rows_bwd)


@jax.custom_vjp
def _from_rows(out: jax.Array, weights: jax.Array, layout: _Layout) -> jax.Array:
    """[N, H]: per token, the sum over its k picks of the pick's row of `out` [R, H]
    times its routing weight (weights [N, k])."""
    k = weights.shape[1]
    w = weights.astype(out.dtype)
    return sum(w[:, j, None] * _rows_of(out, layout.token_rows[:, j]) for j in range(k))


def _from_rows_fwd(out, weights, layout):
    return _from_rows(out, weights, layout), (out, weights, layout)


def _from_rows_bwd(res, g):
    out, weights, layout = res
    k = weights.shape[1]
    # Each row gets its token's gradient times the row's weight (none: zero)...
    w_row = _rows_of(weights.reshape(-1), layout.row_assignment)
    d_out = _rows_of(g, layout.row_token) * w_row.astype(g.dtype)[:, None]
    # ...and each weight the dot of its token's gradient with its row's output.
    d_w = jnp.stack(
        [jnp.sum(g * _rows_of(out, layout.token_rows[:, j]), axis=-1) for j in range(k)], axis=1
    )
    return d_out, d_w.astype(weights.dtype), None


_from_rows.defvjp(_from_rows_fwd, _from_rows_bwd)


def tiled_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """`dropless_experts`' result by batched matmuls over fixed-size tiles of rows.

    The assignments are sorted by expert as there, and each expert's run of rows is padded
    to a multiple of `dispatch_tile` rows, so that every tile belongs to one expert: the
    tiles then go through one batched matmul with their experts' kernels gathered per tile
    (MegaBlocks' block-sparse layout, Gale et al. 2023). Still dropless, with no capacity
    factor: the padding is at most tile - 1 rows per expert, zeros that are never read
    back. XLA:CPU runs this several times faster than its lowering of
    `jax.lax.ragged_dot` (benchmarks/results/moe_dispatch.md), which accelerators run natively.
    An expert id of E (not held here) gets no row and adds nothing, as there."""
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    tile = dispatch_tile(n * k, num_experts)
    flat = experts.reshape(-1)
    order, sizes = _sort_by_expert(experts, num_experts)
    padded = (sizes + tile - 1) // tile * tile
    ends = jnp.cumsum(padded)
    num_tiles = (n * k + num_experts * (tile - 1)) // tile  # the most the padding can need
    # Each tile gathers its expert's three kernels: at a real shape (Qwen3-30B-A3B: 19 MB a
    # tile, ~1,000 tiles a layer per device) all tiles at once would hold GiBs of copies,
    # so past `TILE_KERNEL_BYTES` the tiles go in blocks, one after another, each block's
    # copies recomputed in the backward pass instead of kept. The tiles are rounded up to
    # whole blocks (zero tiles), so that the blocks are a reshape, not a padded copy.
    per_tile = sum(w[0].size for w in (w_gate, w_up, w_down)) * jnp.dtype(x.dtype).itemsize
    block = min(num_tiles, max(1, TILE_KERNEL_BYTES // per_tile))
    num_blocks = -(-num_tiles // block)
    num_tiles = num_blocks * block
    by_expert = flat[order]
    # Each assignment's row in the padded layout: its expert's padded start + its rank
    # among that expert's assignments.
    rank = jnp.arange(n * k) - (jnp.cumsum(sizes) - sizes)[by_expert]
    # An assignment to an expert not held here gets a slot past the end: no row.
    slot = jnp.where(by_expert < num_experts, (ends - padded)[by_expert] + rank, num_tiles * tile)
    layout = _Layout.of(order, slot, (n, k), num_tiles * tile)
    rows = _to_rows(x, layout).reshape(num_tiles, tile, -1)
    # Tiles past the last expert's rows hold zeros; any expert's kernel gives them zeros.
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(num_tiles) * tile, side="right"),
                        num_experts - 1)  # fmt: skip

    def tiles_mlp(rows: jax.Array, owner: jax.Array) -> jax.Array:
        gate = jnp.einsum("tsh,thi->tsi", rows, w_gate[owner].astype(x.dtype))
        up = jnp.einsum("tsh,thi->tsi", rows, w_up[owner].astype(x.dtype))
        return jnp.einsum("tsi,tih->tsh", jax.nn.silu(gate) * up, w_down[owner].astype(x.dtype))

    if num_blocks == 1:
        out = tiles_mlp(rows, owner)
    else:
        blocks = (rows.reshape(num_blocks, block, tile, -1), owner.reshape(num_blocks, block))
        out = jax.lax.map(jax.checkpoint(lambda a: tiles_mlp(*a)), blocks)
    return _from_rows(out.reshape(num_tiles * tile, -1), weights, layout)


# The most bytes of expert kernels `tiled_experts` gathers for its tiles at once.
TILE_KERNEL_BYTES = 1 << 30


def dispatch_tile(assignments: int, num_experts: int) -> int:
    """Rows per tile of `tiled_experts`: about an expert's even share of the (token, pick)
    assignments, a power of two in [8, 128] (larger tiles make faster matmuls, smaller
    ones less padding; decoding a few rows must not pad each expert to 128)."""
    share = max(1, assignments // num_experts)
    return int(min(128, max(8, 1 << (share - 1).bit_length())))


# model.moe_dispatch: how the experts run (the same numbers; tests/tpu_jobs/test_moe.py).
DISPATCH: dict[str, Callable[..., jax.Array]] = {
    "ragged_dot": dropless_experts,
    "tiled": tiled_experts,
}
# "auto" by platform: XLA:CPU lowers ragged_dot to slow code (measured 3.5-3.8x the tiled
# experts' time at the demo_moe batch, 17-23x at 128 experts, forward and backward:
# benchmarks/results/moe_dispatch.md); GPU and TPU have native grouped matmuls for it.
AUTO_DISPATCH = {"cpu": "tiled"}


def dispatch(name: str, platform: str) -> Callable[..., jax.Array]:
    """The experts' function of `model.moe_dispatch` on `platform` (jax.default_backend())."""
    if name == "auto":
        name = AUTO_DISPATCH.get(platform, "ragged_dot")
    return DISPATCH[name]


# The axes a MoE layer's tokens are split over inside `expert_parallel`: every batch axis
# and then `tensor`, whose ranks would otherwise all run the same rows (the experts are
# gathered whole per device instead of split by columns).
TOKEN_AXES = (*BATCH_AXES, "tensor")


def expert_parallel(
    fn: Callable[..., jax.Array],
    mesh: jax.sharding.AbstractMesh,
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """`fn(x, experts, weights, w_gate, w_up, w_down)` (a `DISPATCH` function) run per
    device under `mesh`: the same [N, H] result, with no buffer of the whole batch.

    Each device takes its slice of the N tokens (split over `TOKEN_AXES`, as far as they
    divide N) and gathers its experts' kernels whole (their FSDP and tensor pieces; the
    gradient reduce-scatters back, as FSDP's). When the experts are split over `expert`,
    the tokens of the expert group are gathered, each device runs only the assignments to
    the experts it holds (the others get the id E_held), and the partial outputs are summed
    and scattered back to the tokens' devices: an all-gather and a reduce-scatter of
    `expert` x the local tokens' rows per layer, and a sort of only those."""
    n = x.shape[0]
    tokens = fit_spec(P(TOKEN_AXES), (n,), mesh)[0]
    token_axes = () if tokens is None else tokens if isinstance(tokens, tuple) else (tokens,)
    # The kernels' own placement (tpu_jobs.model.mesh.PARAM_RULES); up's is gate's.
    gate_spec = spec_for("layers.0.mlp.experts.gate_proj.kernel", w_gate.shape, mesh)
    down_spec = spec_for("layers.0.mlp.experts.down_proj.kernel", w_down.shape, mesh)
    split = gate_spec[0] == "expert" and down_spec[0] == "expert"
    gather_tokens = split and "expert" in token_axes

    def whole(w: jax.Array, spec: P) -> jax.Array:
        for dim, entry in enumerate(spec):
            if dim and entry is not None:
                w = jax.lax.all_gather(w, entry, axis=dim, tiled=True)
        return w

    def local(x, experts, weights, w_gate, w_up, w_down):
        w_gate, w_up, w_down = (
            whole(w_gate, gate_spec),
            whole(w_up, gate_spec),
            whole(w_down, down_spec),
        )
        if gather_tokens:
            x, experts, weights = (
                jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x, experts, weights)
            )
        if split:
            held = w_gate.shape[0]
            ids = experts - jax.lax.axis_index("expert") * held
            experts = jnp.where((ids >= 0) & (ids < held), ids, held)  # held: not here
        y = fn(x, experts, weights, w_gate, w_up, w_down)
        if gather_tokens:
            return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, "expert") if split else y

    rows = P(tokens)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, rows, rows, gate_spec, gate_spec, down_spec),
        out_specs=rows,
    )(x, experts, weights, w_gate, w_up, w_down)


def _token_weights(mask: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    """[layers, B, T] float32 weights of the real tokens (mask [B, T]; None: all)."""
    if mask is None:
        return jnp.ones(shape, jnp.float32)
    return jnp.broadcast_to(mask.astype(jnp.float32), shape)


def load_balancing_loss(router: RouterOutputs, mask: jax.Array | None = None) -> jax.Array:
    """The Switch Transformer's auxiliary loss as transformers' `load_balancing_loss_func`:
    E * sum_e f_e * P_e, with f_e the share of (token, pick) assignments that went to
    expert e times k (each token counts k times) and P_e the mean router probability of
    expert e, both over every real token (mask [B, T], 1 = real) of every layer. Minimal
    (k) when load and probability are uniform. A scalar float32; its gradient reaches the
    router through P only (f counts discrete choices)."""
    num_experts = router.logits.shape[-1]
    w = _token_weights(mask, router.logits.shape[:-1])
    total = jnp.maximum(jnp.sum(w), 1.0)
    probs = jax.nn.softmax(router.logits.astype(jnp.float32), axis=-1)
    picks = jnp.sum(jax.nn.one_hot(router.experts, num_experts, dtype=jnp.float32), axis=-2)
    f = jnp.einsum("...e,...->e", picks, w) / total
    p = jnp.einsum("...e,...->e", probs, w) / total
    return num_experts * jnp.sum(f * p)


def router_z_loss(router: RouterOutputs, mask: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: the mean over real tokens and layers of
    logsumexp(router logits)^2, which keeps the logits small (bf16 round-off grows with
    them). A scalar float32."""
    w = _token_weights(mask, router.logits.shape[:-1])
    z = jax.nn.logsumexp(router.logits.astype(jnp.float32), axis=-1)
    return jnp.sum(w * z * z) / jnp.maximum(jnp.sum(w), 1.0)


def expert_load_metrics(
    router: RouterOutputs, mask: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Per-step diagnostics of the routing over real tokens: `expert_load_max` = the most
    loaded expert's (token, pick) assignments over the mean expert's, per layer, the max
    over layers (1 = perfectly balanced, E / k = every token on the same k experts);
    `expert_load_min` likewise the least loaded's (0: an expert that got no token);
    `router_entropy` = the mean entropy (nats) of the router's softmax (log E = uniform)."""
    num_experts = router.logits.shape[-1]
    w = _token_weights(mask, router.logits.shape[:-1])
    picks = jnp.sum(jax.nn.one_hot(router.experts, num_experts, dtype=jnp.float32), axis=-2)
    per_layer = jnp.einsum("l...e,l...->le", picks, w)  # [layers, E]
    mean = jnp.maximum(jnp.mean(per_layer, axis=-1), 1e-9)
    logp = jax.nn.log_softmax(router.logits.astype(jnp.float32), axis=-1)
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return {
        "expert_load_max": jnp.max(jnp.max(per_layer, axis=-1) / mean),
        "expert_load_min": jnp.min(jnp.min(per_layer, axis=-1) / mean),
        "router_entropy": jnp.sum(w * entropy) / jnp.maximum(jnp.sum(w), 1.0),
    }


def router_loss(
    router: RouterOutputs, mask: jax.Array | None, aux_coef: float, z_coef: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(aux_coef * load_balancing_loss + z_coef * router_z_loss, metrics): the router's
    part of a training objective (`model.router_aux_loss_coef`, `router_z_loss_coef`) and
    its metrics (both losses and `expert_load_metrics`)."""
    aux, z = load_balancing_loss(router, mask), router_z_loss(router, mask)
    metrics = {"router_aux_loss": aux, "router_z_loss": z, **expert_load_metrics(router, mask)}
    return aux_coef * aux + z_coef * z, metrics
