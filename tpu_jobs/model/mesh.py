"""Device meshes and sharding rules for the trainer and the sampler.

Mesh axes (outermost first):

* ``data``   - pure data parallelism: parameters replicated, batch split.
* ``fsdp``   - data parallelism with parameters (and optimizer state) split too (ZeRO-3
  style): the batch is split over ``("data", "fsdp")`` and each weight matrix over
  ``fsdp`` along its non-tensor dimension; XLA all-gathers weights where they are used.
* ``tensor`` - Megatron-style tensor parallelism: q/k/v/gate/up kernels split by output
  column (heads / intermediate units), o/down kernels by input row, vocabulary split for
  the embedding and LM head. On TPU keep it within a slice (ICI), on GPUs within a node.
* ``expert`` - expert parallelism for mixture-of-experts models: each stacked expert
  kernel [E, ...] is split over ``expert`` along E (and over ``fsdp``/``tensor`` along its
  other dimensions, as a dense MLP's), so a device holds E / expert experts. The batch is
  split over it too (``data x fsdp x expert``): outside the experts it is one more data
  axis, and the other parameters are replicated over it (a dense model's rules never name
  it). A 3-entry shape means expert = 1, so meshes of dense runs are unchanged.

Which parameter gets which `PartitionSpec` is data (`PARAM_RULES`): regexes on the flat
parameter names of `tpu_jobs.model.transformer` (``layers.3.mlp.down_proj.kernel``), first match wins.
The same rules apply to any pytree that embeds the parameters (optimizer states name their
leaves ``0.mu.layers.3.mlp.down_proj.kernel``), so Adam moments follow their parameters.
An axis that does not divide a dimension is dropped for that dimension (replicated), so
every rule set works on every mesh shape; only efficiency changes.

Each role has its own mesh (`role_meshes`): in one process the roles get disjoint device
slices; in the usual deployment each role is its own process (or job) and uses all of its
devices. Multi-host: call `initialize_distributed` first thing (see docs/scaling.md).
Meshes use `AxisType.Auto` axes: shardings propagate through jit (GSPMD), so the model
code carries no sharding annotations.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = ("data", "fsdp", "expert")  # the batch dimension is split over all three

# (regex on the flat name, spec). Kernels are [in, out] (see tpu_jobs.model.transformer).
PARAM_RULES: tuple[tuple[str, P], ...] = (
    # [vocab, hidden]: vocabulary-parallel over every model axis, so the LM head (tied or
    # not) computes each device's slice of the logits without gathering the weight.
    (r"(^|\.)embed_tokens\.embedding$", P(("tensor", "fsdp"))),
    (r"\.self_attn\.[qkv]_proj\.kernel$", P("fsdp", "tensor")),  # column parallel
    (r"\.self_attn\.[qkv]_proj\.bias$", P("tensor")),
    (r"\.self_attn\.o_proj\.kernel$", P("tensor", "fsdp")),  # row parallel
    (r"\.mlp\.(shared_expert\.)?(gate|up)_proj\.kernel$", P("fsdp", "tensor")),
    (r"\.mlp\.(shared_expert\.)?down_proj\.kernel$", P("tensor", "fsdp")),
    # A MoE layer's stacked experts, [E, hidden, inter] / [E, inter, hidden]: experts over
    # `expert`, each expert's kernel as a dense MLP's. The router (mlp.gate) is replicated.
    (r"\.mlp\.experts\.(gate|up)_proj\.kernel$", P("expert", "fsdp", "tensor")),
    (r"\.mlp\.experts\.down_proj\.kernel$", P("expert", "tensor", "fsdp")),
    (r"(^|\.)lm_head\.kernel$", P(None, ("tensor", "fsdp"))),  # [hidden, vocab]
    (r".*", P()),  # norms (incl. q_norm/k_norm), optimizer counters: replicated
)


# --------------------------------------------------------------------------- meshes


def platform_of(mesh: Mesh | None) -> str:
    """The platform ("cpu", "gpu", "tpu") a program runs on: the mesh's devices', else the
    default device's (no mesh: one device)."""
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    return device.platform


def make_mesh(shape: Sequence[int], devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor, expert) mesh from a shape of 4 entries, or of 3 (expert = 1).
    One entry may be -1: all remaining devices.

    Uses `jax.make_mesh` (topology-aware device order on TPU) with Auto axes.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_shape(shape, len(devices))
    if math.prod(shape) != len(devices):
        devices = devices[: math.prod(shape)]
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def resolve_shape(shape: Sequence[int], n_devices: int) -> tuple[int, ...]:
    """The 4-entry shape of `shape` (3 entries: expert = 1) with its -1 entry filled;
    check the product fits in `n_devices`."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == len(AXES) - 1:
        shape = (*shape, 1)  # (data, fsdp, tensor): no expert axis, as before it existed
    if len(shape) != len(AXES) or any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
        raise ValueError(
            f"mesh shape {shape} is invalid; allowed: {len(AXES)} positive sizes for "
            f"{AXES} (or 3, expert = 1), at most one of them -1 (all remaining devices)"
        )
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        if n_devices % rest:
            raise ValueError(
                f"mesh shape {shape}: {n_devices} devices are not a multiple of {rest}"
            )
        shape = tuple(n_devices // rest if s == -1 else s for s in shape)
    if math.prod(shape) > n_devices:
        raise ValueError(
            f"mesh shape {shape} needs {math.prod(shape)} devices; only {n_devices} available"
        )
    return shape


def role_meshes(
    shapes: Mapping[str, Sequence[int]], devices: Sequence[Any] | None = None
) -> dict[str, Mesh]:
    """One mesh per role on disjoint, consecutive slices of `devices` (in `shapes` order).

    A -1 entry in the last role's shape takes the devices the other roles left.
    E.g. ``role_meshes({"trainer": (1, 4, 1), "sampler": (-1, 1, 1)})`` on 8 devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    out, start = {}, 0
    items = list(shapes.items())
    for i, (role, shape) in enumerate(items):
        if -1 in tuple(shape) and i != len(items) - 1:
            raise ValueError(f"mesh of role {role!r}: only the last role may use -1")
        resolved = resolve_shape(shape, len(devices) - start)
        n = math.prod(resolved)
        out[role] = make_mesh(resolved, devices[start : start + n])
        start += n
    return out


def config_meshes(
    mesh_cfg: Any, roles: Sequence[str], devices: Sequence[Any] | None = None
) -> dict[str, Mesh | None]:
    """The meshes of `roles` ("trainer", "sampler") from a run config's `mesh` section
    (`pipeline.mesh.MeshConfig`); None for a role whose shape is None (one device,
    nothing sharded).

    One sharded role (a role's own process, the usual deployment): a mesh over all the
    `devices` (default `jax.devices()`). Several (roles sharing one process): disjoint
    consecutive device slices in `roles` order (`role_meshes`).
    """
    shapes = {r: getattr(mesh_cfg, r) for r in roles if getattr(mesh_cfg, r) is not None}
    out: dict[str, Mesh | None] = dict.fromkeys(roles)
    try:
        if len(shapes) == 1:
            ((role, shape),) = shapes.items()
            out[role] = make_mesh(shape, devices)
        elif shapes:
            out.update(role_meshes(shapes, devices))
    except ValueError as err:
        n = len(jax.devices() if devices is None else devices)
        given = ", ".join(f"mesh.{r}={list(s)}" for r, s in shapes.items())
        raise ValueError(
            f"{given} on the {n} device(s) of this process: {err}; set the run config's "
            "mesh section for this machine (null = one device)"
        ) from None
    return out


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    *,
    auto: bool = False,
) -> bool:
    """Start JAX's multi-process runtime when configured; must run before any JAX op.

    Explicit arguments win; else the environment variables RLAX_COORDINATOR
    (host:port of process 0), RLAX_NUM_PROCESSES and RLAX_PROCESS_ID. With none of them,
    `auto=True` lets JAX detect the cluster (Cloud TPU pod slices, Slurm, Open MPI);
    otherwise nothing happens (single process). Returns True if initialised here.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("RLAX_COORDINATOR") or None
    if num_processes is None and env.get("RLAX_NUM_PROCESSES"):
        num_processes = int(env["RLAX_NUM_PROCESSES"])
    if process_id is None and env.get("RLAX_PROCESS_ID"):
        process_id = int(env["RLAX_PROCESS_ID"])
    explicit = coordinator_address is not None or num_processes is not None
    if not explicit and not auto:
        return False
    if explicit and (coordinator_address is None or num_processes is None or process_id is None):
        raise ValueError(
            "multi-process start needs coordinator_address, num_processes and process_id "
            f"together (got {coordinator_address!r}, {num_processes!r}, {process_id!r}); "
            "set RLAX_COORDINATOR, RLAX_NUM_PROCESSES, RLAX_PROCESS_ID or use auto=True on "
            "TPU pods / Slurm / Open MPI"
        )
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )
    return True


# --------------------------------------------------------------------------- specs


def path_name(path: Sequence[Any]) -> str:
    """Dotted name of a pytree key path: ``layers.0.mlp.down_proj.kernel`` (NNX's `.value`
    attribute dropped), matching the flat names of `tpu_jobs.model.transformer.flat_params`."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            if key.name not in ("value", "raw_value"):
                parts.append(key.name)
        else:
            parts.append(str(getattr(key, "key", key)))
    return ".".join(parts)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """`spec` with, per dimension, only the leading mesh axes whose sizes divide it."""
    entries = list(spec)[: len(shape)]
    out = []
    for dim, entry in zip(shape, entries, strict=False):
        if entry is None:
            out.append(None)
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        kept, size = [], 1
        for name in names:
            if dim % (size * mesh.shape[name]) == 0:
                kept.append(name)
                size *= mesh.shape[name]
            else:
                break
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def spec_for(
    name: str, shape: Sequence[int], mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES
) -> P:
    for pattern, spec in rules:
        if re.search(pattern, name):
            return fit_spec(spec, shape, mesh)
    return P()


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
    """A pytree of NamedSharding matching `tree` (params, optimizer state, ...)."""

    def one(path, leaf):
        return NamedSharding(mesh, spec_for(path_name(path), np.shape(leaf), mesh, rules))

    return jax.tree_util.tree_map_with_path(one, tree)


def _put(tree: Any, shardings: Any) -> Any:
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    # Multi-host: every process holds the full value (e.g. pulled from the parameter server)
    # and contributes the shards of its own devices.
    def one(leaf: Any, sharding: NamedSharding) -> jax.Array:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            # Already global (e.g. optimizer moments made from placed params): when the mesh
            # splits it across processes no process can read all of it; reshard on device.
            return jax.device_put(leaf, sharding)
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(one, tree, shardings)


def shard_tree(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
    """Place `tree` on `mesh` following `rules` (a no-op for leaves already placed so)."""
    return _put(tree, tree_shardings(tree, mesh, rules))


def shard_model(model: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARAM_RULES) -> Any:
    """Shard an NNX module's parameters in place (for the sampler/evaluator); returns it."""
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    nnx.update(model, shard_tree(state, mesh, rules))
    return model


def split_axes(
    shapes: Mapping[str, Sequence[int]],
    parts: int,
    rules: Sequence[tuple[str, P]] = PARAM_RULES,
    axis: str = "tensor",
) -> dict[str, int | None]:
    """{flat parameter name: the dimension a sampler mesh of `parts` ranks on `axis`
    ("tensor", or "expert": `pipeline.mesh.piece_axis`) splits, or None (replicated)}:
    where the parameter server cuts each weight into per-rank pieces, so a piece is exactly
    what one rank's devices hold (`rules`, `fit_spec`)."""
    from jax.sharding import AbstractMesh

    sizes = tuple(parts if a == axis else 1 for a in AXES)
    mesh = AbstractMesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    out: dict[str, int | None] = {}
    for name, shape in shapes.items():
        spec = spec_for(name, shape, mesh, rules) if parts > 1 else P()
        dims = [
            d
            for d, entry in enumerate(spec)
            if entry == axis or (isinstance(entry, tuple) and axis in entry)
        ]
        out[name] = dims[0] if dims else None
    return out


def tensor_ranks(
    mesh: Mesh, devices: Sequence[Any] | None = None, axis: str = "tensor"
) -> frozenset[int] | None:
    """The `axis` indices ("tensor", or "expert": `pipeline.mesh.piece_axis`) of `mesh` that
    `devices` (default: this process's addressable devices) occupy: the pieces of a version
    this host must download. None when they are all of them (nothing to skip)."""
    if devices is None:
        devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    wanted = set(devices)
    index_of = AXES.index(axis)
    ranks = {
        int(index[index_of]) for index, device in np.ndenumerate(mesh.devices) if device in wanted
    }
    return None if len(ranks) == mesh.shape[axis] else frozenset(ranks)


def batch_size_multiple(mesh: Mesh) -> int:
    """Global batch sizes must be multiples of this (the data x fsdp x expert size)."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) dimension split over data x fsdp x expert; the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def shard_batch(tree: Any, mesh: Mesh, *, process_local: bool = False) -> Any:
    """Split every array of `tree` along its leading dimension over data x fsdp x expert.

    `process_local=False`: every process passes the same global batch (the sampler).
    `process_local=True` (multi-host data loading): each process passes only its own rows,
    the global batch being the processes' rows concatenated in process order.
    """
    multiple = batch_size_multiple(mesh)
    if process_local and jax.process_count() > 1:
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                batch_sharding(mesh, np.ndim(x)), np.asarray(x)
            ),
            tree,
        )
    for x in jax.tree.leaves(tree):
        if np.shape(x)[0] % multiple:
            raise ValueError(
                f"batch of {np.shape(x)[0]} rows cannot be split over data x fsdp x expert = {multiple}; "
                f"allowed: a multiple of {multiple}"
            )
    return _put(tree, jax.tree.map(lambda x: batch_sharding(mesh, np.ndim(x)), tree))


def to_host(tree: Any) -> Any:
    """NumPy copies of (possibly multi-host) global arrays, complete on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def cache_sharding(mesh: Mesh, cache: Any) -> Any:
    """Shardings for a `tpu_jobs.model.transformer.KVCache` (either layout): batch over data x fsdp x expert,
    KV heads over tensor when they divide (matching the column-parallel k/v kernels).
    The cache's own class is kept (`dataclasses.replace`), so this module needs no import
    of the model's (tpu_jobs.model.moe imports this one for the parameters' rules)."""
    if cache.per_layer:  # k[i]: [B, kv, hd, S], v[i]: [B, kv, S, hd]
        heads = cache.k[0].shape[1]
        spec = P(BATCH_AXES, "tensor" if heads % mesh.shape["tensor"] == 0 else None)
        kv = NamedSharding(mesh, spec)
        k, v = (kv,) * len(cache.k), (kv,) * len(cache.v)
    else:  # [L, B, S, kv, hd]
        heads = cache.k.shape[3]
        spec = P(None, BATCH_AXES, None, "tensor" if heads % mesh.shape["tensor"] == 0 else None)
        k = v = NamedSharding(mesh, spec)
    return dataclasses.replace(cache, k=k, v=v, mask=batch_sharding(mesh, 2))


def describe(tree: Any) -> dict[str, str]:
    """{name: PartitionSpec string} of a placed pytree (for logs and tests)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = getattr(leaf, "sharding", None)
        out[path_name(path)] = str(getattr(sharding, "spec", sharding))
    return out
