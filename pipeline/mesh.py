"""The run's `mesh` section: the shapes of the roles' device meshes. No jax here: the
meshes themselves are built by `tpu_jobs/model/mesh.py`; the parameter server reads the
sampler's tensor (or expert) size to cut versions into pieces (`pipeline.paramserver.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config_io import coerce, optional_types
from pipeline.errors import check as _check

# = tpu_jobs.model.mesh.AXES (this module imports no jax). A shape may leave out the last
# axis, `expert` (3 entries: expert = 1, the shapes of runs from before it existed).
MESH_AXES = ("data", "fsdp", "tensor", "expert")
# The axes the parameter server can cut a version's pieces along (`piece_axis`).
PIECE_AXES = ("tensor", "expert")


def axis_size(shape: tuple[int, ...] | None, axis: str) -> int | None:
    """The `axis` entry of a mesh shape (-1: all remaining devices; 1 for `expert` of a
    3-entry shape); None for no mesh."""
    if shape is None:
        return None
    i = MESH_AXES.index(axis)
    return shape[i] if i < len(shape) else 1


def piece_axis(shape: tuple[int, ...] | None) -> str:
    """The axis of the sampler's mesh `shape` whose ranks the parameter server cuts a
    version into pieces for (`pipeline.paramserver.config`): the one of `PIECE_AXES` that is
    not 1 ("tensor" when neither is; `MeshConfig` refuses both)."""
    used = _split_piece_axes(shape)
    return used[0] if used else PIECE_AXES[0]


def _split_piece_axes(shape: tuple[int, ...] | None) -> list[str]:
    """The axes of `PIECE_AXES` that `shape` splits (size > 1 or -1)."""
    return [a for a in PIECE_AXES if axis_size(shape, a) not in (None, 1)]


@dataclass(frozen=True)
class MeshConfig:
    """Device meshes of the roles (`tpu_jobs/model/mesh.py`, docs/scaling.md).

    A shape is (data, fsdp, tensor, expert), or (data, fsdp, tensor) with expert = 1; one
    entry may be -1 (all remaining devices). `expert` splits a mixture-of-experts model's
    experts over devices (expert parallelism, with fsdp and tensor on the experts' other
    dimensions; the batch is split over data x fsdp x expert). None
    (the default) = one device, nothing sharded. `trainer` places the train state and
    batches (the rollout batch's rows, prompts_per_batch * group_size, and micro-batches
    must be multiples of data * fsdp * expert); `sampler` is the mesh of the rollout
    workers, the evaluator and pass-rate jobs (usually (-1, 1, 1): data parallel; never
    fsdp; tensor or expert, not both: the parameter server cuts versions along one). Each role
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
                len(value) in (len(MESH_AXES) - 1, len(MESH_AXES))
                and all(s >= 1 or s == -1 for s in value)
                and value.count(-1) <= 1,
                f"mesh.{name}",
                list(value),
                f"null (one device) or {len(MESH_AXES)} sizes for {MESH_AXES} (or 3: expert "
                "= 1), each >= 1 or -1 (all remaining devices, at most one entry)",
            )
        _check(
            len(_split_piece_axes(self.sampler)) <= 1,
            "mesh.sampler",
            None if self.sampler is None else list(self.sampler),
            "tensor or expert > 1, not both (the parameter server cuts a version into the "
            "pieces of one of them)",
        )
        _check(
            isinstance(self.distributed, bool), "mesh.distributed", self.distributed, "true/false"
        )
