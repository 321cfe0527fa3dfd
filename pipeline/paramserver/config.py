"""The run's `paramserver` section: how the trainer publishes weight versions and the
workers pull them."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline import weight_codec
from pipeline.errors import check as _check
from pipeline.errors import one_of as _one_of
from pipeline.mesh import axis_size, piece_axis

# The dtypes a version may be published in: the codec's, or "sampler" (follow sampler.dtype).
PUBLISH_DTYPES = ("sampler", *weight_codec.PUBLISH_DTYPES)


@dataclass(frozen=True)
class ParamServerConfig:
    """How the trainer publishes weight versions and the workers pull them
    (`pipeline/paramserver/`, docs/parameter-server.md, docs/scale-model.md).

    dtype: the dtype of published versions: "sampler" (the default: `sampler.dtype`, so
        float32 on CPU and bfloat16 where the workers sample in bfloat16), "float32" or
        "bfloat16". The trainer keeps float32 master weights in its checkpoints either way.
    full_every: every `full_every`-th version is a full snapshot; the others are XOR deltas
        against the previous version (and full versions carry one too, so a worker holding
        the previous version never needs the full one). 1 (the default): every version full,
        no deltas, as runs before this option.
    tensor_parts: weights the sampler's mesh splits over its `tensor` axis (or, on a mesh
        with expert > 1, its `expert` axis: each expert kernel [E, ...] along E) are stored
        in this many pieces, one per rank, so a host downloads only its ranks' bytes (its
        experts). 0 (the default): that axis's size in `mesh.sampler` when it is a fixed
        number, else 1.
    pull_concurrency: parallel (ranged) reads of one pull, and parallel uploads of a publish.
    shard_mib: shard objects of small pieces are grouped up to this size.
    range_mib: one ranged read of a remote shard object.
    """

    dtype: str = "sampler"
    full_every: int = 1
    tensor_parts: int = 0
    pull_concurrency: int = 8
    shard_mib: int = 64
    range_mib: int = 16

    def __post_init__(self) -> None:
        _one_of("paramserver.dtype", self.dtype, PUBLISH_DTYPES)
        _check(self.full_every >= 1, "paramserver.full_every", self.full_every,
               ">= 1 (1: every version a full snapshot, no deltas)")  # fmt: skip
        _check(self.tensor_parts >= 0, "paramserver.tensor_parts", self.tensor_parts,
               ">= 0 (0: the tensor size of mesh.sampler)")  # fmt: skip
        for name in ("pull_concurrency", "shard_mib", "range_mib"):
            _check(getattr(self, name) >= 1, f"paramserver.{name}", getattr(self, name), ">= 1")

    def publish_dtype(self, sampler_dtype: str) -> str:
        return sampler_dtype if self.dtype == "sampler" else self.dtype

    def parts(self, sampler_mesh: tuple[int, ...] | None) -> int:
        """Ranks (of the sampler mesh's `piece_axis`) a version is split into."""
        if self.tensor_parts:
            return self.tensor_parts
        size = axis_size(sampler_mesh, piece_axis(sampler_mesh))
        return size if size and size > 0 else 1
