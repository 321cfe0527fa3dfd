"""Sharding constraints on activations, by logical axis names (the MaxText / levanter way).

With `Auto` mesh axes and nothing pinned inside the model, XLA's sharding propagation is
free to choose how each activation is split, and for an FSDP train step it chose badly:
it all-gathered activations across the batch for the weight-gradient matmuls, kept the
full LM-head logits on every device and all-reduced gradients (the 7B step peaked at
169.5 GiB per device on 8 devices for a 14.2 GiB per-device state). Pinning the
activations to "batch split over data x fsdp, features per the tensor axis" leaves XLA
one sensible plan: gather each layer's weights where it is used, keep every activation
an 1/N slice, and reduce-scatter the weight gradients into the parameters' shardings.

The model code names the dimensions of an activation (`constrain(x, "batch", None,
"heads", None)`); `ACTIVATION_RULES` maps each name to mesh axes. Outside a mesh context
(`jax.set_mesh`), or on a mesh without these axes, a constraint is a no-op, so the same
code runs unsharded on one device and the tests' numbers do not move.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

# logical dimension name -> mesh axes (tpu_jobs.model.mesh.AXES). None: replicated.
ACTIVATION_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),  # rows of a batch: data parallelism of all kinds
    "heads": ("tensor",),  # attention heads (query and KV): column-parallel q/k/v
    "mlp": ("tensor",),  # the MLP's intermediate units: column-parallel gate/up
    # The LM head's logits: vocabulary-parallel over every model axis, like its weight
    # (tpu_jobs.model.mesh.PARAM_RULES); the head's few rows of hidden states are gathered instead.
    "vocab": ("tensor", "fsdp"),
}


def _axes_of(mesh: jax.sharding.AbstractMesh, name: str | None, dim: int) -> tuple[str, ...]:
    """The leading mesh axes of `name`'s rule whose sizes divide `dim` (tpu_jobs.model.mesh's
    `fit_spec` rule: an axis that does not divide a dimension leaves it replicated)."""
    if name is None:
        return ()
    if name not in ACTIVATION_RULES:
        raise ValueError(
            f"logical axis {name!r} is unknown; allowed: {', '.join(ACTIVATION_RULES)} or None"
        )
    kept, size = [], 1
    for axis in ACTIVATION_RULES[name] or ():
        n = mesh.shape.get(axis)
        if n is None or dim % (size * n):
            break
        kept.append(axis)
        size *= n
    return tuple(kept)


def logical_spec(
    mesh: jax.sharding.AbstractMesh, shape: Sequence[int], names: Sequence[str | None]
) -> P:
    """The PartitionSpec of an activation of `shape` whose dimensions are `names`."""
    if len(names) != len(shape):
        raise ValueError(f"{len(names)} axis names {tuple(names)} for a shape {tuple(shape)}")
    entries = []
    for dim, name in zip(shape, names, strict=True):
        axes = _axes_of(mesh, name, dim)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)


def current_mesh() -> jax.sharding.AbstractMesh | None:
    """The mesh being traced under (`jax.set_mesh`), or None outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """`x` pinned to the sharding its dimension `names` give under the current mesh;
    `x` unchanged outside a mesh context."""
    mesh = current_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(mesh, x.shape, names))
