"""A role's policy, loaded one way for every job that samples (the rollout worker, the
evaluator, the pass-rate job): the run's tokenizer, the model, the weights of a version,
the sampler mesh and the sampler (`sampler.engine`). What it samples with is the role's
`tpu_jobs.generate.interface.sampling_params`, read where it samples (from the job's
config, which tests may swap)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax

from pipeline.config import ModelConfig
from pipeline.paramserver import Snapshot
from pipeline.run import Run
from pipeline.tokenizer import Tokenizer
from pipeline.tokenizer.run import run_tokenizer
from tpu_jobs.generate.interface import Sampler
from tpu_jobs.generate.registry import make_sampler
from tpu_jobs.model import mesh as meshlib
from tpu_jobs.model.transformer import Transformer, init_model, load_flat_params

# The roles that load a policy -> the job's name in messages. (The rollout worker's judge
# groups sample with its policy, under `sampling_params(cfg, "judge")`.)
POLICY_ROLES = {"rollout": "rollout worker", "eval": "evaluator", "pass_rates": "pass-rate job"}


def sampler_mesh(cfg, job: str) -> jax.sharding.Mesh | None:
    """The sampler mesh of `mesh.sampler` (None: one device) for a job that uses all the
    devices of its process. Sampling jobs are single-process: each host runs its own."""
    if jax.process_count() > 1:
        raise RuntimeError(
            f"the {job} is a single-process job (it claims its own work), but JAX sees "
            f"{jax.process_count()} processes; run one {job} per host on single-host "
            "machines (mesh.distributed applies to the trainer only)"
        )
    return meshlib.config_meshes(cfg.mesh, ("sampler",))["sampler"]


@dataclass
class Policy:
    """What a sampling job samples with. `version`: the weight version in `model` (None:
    the initial weights, before any `load`)."""

    role: str
    tok: Tokenizer
    model: Transformer
    mesh: jax.sharding.Mesh | None
    sampler: Sampler
    version: int | None = None

    def load(self, snapshot: Snapshot) -> None:
        """Put `snapshot`'s weights into the model, placed on the mesh once here rather
        than in every generate call."""
        load_flat_params(self.model, snapshot.tensors)
        if self.mesh is not None:
            meshlib.shard_model(self.model, self.mesh)
        self.version = snapshot.version


def load_policy(
    run: Run,
    role: str,
    *,
    snapshot: Snapshot | None = None,
    mesh: jax.sharding.Mesh | None = None,
    model: ModelConfig | None = None,
) -> Policy:
    """The policy of `role` (a name in POLICY_ROLES) for `run`: its tokenizer, the model
    (`snapshot`'s weights when given; else load a version later with `Policy.load`), the
    sampler on `mesh` (None: `mesh.sampler` of the run config, None there too: one
    device). `model`: another shape than the run's `model` section (a pinned teacher's,
    `pipeline.teacher.teacher_config`), for the model and the sampler's caches alike."""
    if role not in POLICY_ROLES:
        raise ValueError(f"role={role!r} is invalid; allowed: {', '.join(map(repr, POLICY_ROLES))}")
    cfg = run.config if model is None else dataclasses.replace(run.config, model=model)
    tok = run_tokenizer(run)
    mesh = mesh or sampler_mesh(cfg, POLICY_ROLES[role])
    model = init_model(cfg.model, cfg.seed)
    sampler = make_sampler(cfg, tok, mesh)
    policy = Policy(role, tok, model, mesh, sampler)
    if snapshot is not None:
        policy.load(snapshot)
    return policy
