"""The run's `mesh` section: the shapes of the roles' device meshes. No jax here: the
meshes themselves are built by `tpu_jobs/model/mesh.py`; the parameter server reads the
sampler's tensor size to cut versions into pieces (`pipeline.paramserver.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config_io import coerce, optional_types
from pipeline.errors import check as _check

MESH_AXES = ("data", "fsdp", "tensor")  # = tpu_jobs.model.mesh.AXES (this module imports no jax)


def tensor_size(shape: tuple[int, ...] | None) -> int | None:
    """The `tensor` entry of a mesh shape (-1: all remaining devices); None for no mesh."""
    return None if shape is None else shape[MESH_AXES.index("tensor")]


@dataclass(frozen=True)
class MeshConfig:
    """Device meshes of the roles (`tpu_jobs/model/mesh.py`, docs/scaling.md).

    A shape is (data, fsdp, tensor); one entry may be -1 (all remaining devices). None
    (the default) = one device, nothing sharded. `trainer` places the train state and
    batches (the rollout batch's rows, prompts_per_batch * group_size, and micro-batches
    must be multiples of data * fsdp); `sampler` is the mesh of the rollout workers, the
    evaluator and pass-rate jobs (usually (-1, 1, 1): data parallel; never fsdp). Each role
    is normally its own process and uses all of its devices; roles sharing a process get
    disjoint device slices (`tpu_jobs.model.mesh.config_meshes`). `distributed`: the trainer
    calls `jax.distributed.initialize` first (multi-host: coordinator from RLAX_COORDINATOR
    / RLAX_NUM_PROCESSES / RLAX_PROCESS_ID, else auto-detected on TPU pods, Slurm, Open MPI).
    """

    trainer: tuple[int, ...] | None = None
    sampler: tuple[int, ...] | None = None
    distributed: bool = False

    def __post_init__(self) -> None:
        for name, kind in optional_types(type(self)).items():
            value = getattr(self, name)
            if value is None:
                continue
            value = coerce(value, kind, f"mesh.{name}")
            object.__setattr__(self, name, value)
            _check(
                len(value) == len(MESH_AXES)
                and all(s >= 1 or s == -1 for s in value)
                and value.count(-1) <= 1,
                f"mesh.{name}",
                list(value),
                f"null (one device) or {len(MESH_AXES)} sizes for {MESH_AXES}, each >= 1 or "
                "-1 (all remaining devices, at most one entry)",
            )
        _check(
            isinstance(self.distributed, bool), "mesh.distributed", self.distributed, "true/false"
        )
