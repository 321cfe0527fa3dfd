"""The multi-host trainer path (`mesh.distributed: true`) on one machine: 2 OS processes with
4 fake CPU devices each (8 global devices), coordinated over 127.0.0.1 by RLAX_COORDINATOR /
RLAX_NUM_PROCESSES / RLAX_PROCESS_ID; cross-process collectives use gloo (jax's CPU default).

* The real entry point, `python -m tpu_jobs.trainer --run RUN`, on `mesh.trainer=[1,4,2]`
  (FSDP across the two processes: every weight and Adam moment is split between them),
  against the same 2 steps in one process on one device (tests/tpu_jobs/test_mesh.py does
  the same comparison on 8 devices of one process).
* The mesh helpers on a (1, 8, 1) mesh that splits the weights across the processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pipeline.ops import launcher
from pipeline.paramserver import ParamServer
from pipeline.run import DONE_KEY
from pipeline.storage import local_path
from tests.local_servers import free_port
from tests.runs import (
    commit_with_random_rewards,
    final_tensors,
    plain_and_variants,
    wait_all,
    xla_flags_with_devices,
)

ROOT = Path(__file__).resolve().parents[2]
PROCESSES, LOCAL_DEVICES = 2, 4


def launch(argv: list[str], logs: Path, name: str) -> dict[str, subprocess.Popen]:
    """Start `argv` as PROCESSES processes of one JAX cluster on 127.0.0.1 (a free port),
    each with LOCAL_DEVICES fake CPU devices; output to logs/{name}-{i}.log."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for i in range(PROCESSES):
        env = {
            **os.environ,
            "XLA_FLAGS": xla_flags_with_devices(LOCAL_DEVICES),
            "JAX_PLATFORMS": "cpu",
            "RLAX_COORDINATOR": f"127.0.0.1:{port}",
            "RLAX_NUM_PROCESSES": str(PROCESSES),
            "RLAX_PROCESS_ID": str(i),
        }
        out = open(logs / f"{name}-{i}.log", "wb")  # noqa: SIM115 - owned by the child
        procs[f"{name}-{i}"] = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    return procs


def read_logs(logs: Path, name: str) -> list[str]:
    """The processes' output, without gloo's per-connection lines."""
    out = []
    for i in range(PROCESSES):
        text = (logs / f"{name}-{i}.log").read_text(errors="replace")
        out.append("\n".join(x for x in text.splitlines() if not x.startswith("[Gloo]")))
    return out


def maxdiff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


@pytest.fixture(scope="module")
def two_process_trainer(tmp_path_factory) -> dict[str, Any]:
    from tpu_jobs.learning.checkpoints import TrainerCheckpoints
    from tpu_jobs.model.state import params_to_flat
    from tpu_jobs.rollout_worker import RolloutWorker
    from tpu_jobs.trainer import Trainer

    root = tmp_path_factory.mktemp("multiprocess")
    runs, base = plain_and_variants(
        str(root), {"multi": ["mesh.trainer=[1,4,2]", "mesh.distributed=true"]}
    )
    plain, multi = runs["plain"], runs["multi"]
    worker = RolloutWorker(plain, "w", log=lambda m: None)
    worker._ensure_version(0)
    rng = np.random.default_rng(0)
    for index in range(plain.config.trainer.steps):
        commit_with_random_rewards(worker.generate_batch(index, 0), (plain, multi), rng)

    t0 = time.time()
    logs = root / "logs"
    procs = launch(launcher.job_command("train", multi.url), logs, "trainer")
    try:  # meanwhile the reference: the same steps in this process on one device
        reference = Trainer(plain, log=lambda m: None)
        ref_state = reference.train()
    finally:
        codes = wait_all(procs, timeout=240)  # kills what is still running then
    out: dict[str, Any] = {"codes": codes, "seconds": time.time() - t0}
    out["logs"] = read_logs(logs, "trainer")
    assert all(c == 0 for c in codes.values()), f"{codes}\n" + "\n----\n".join(
        x[-3000:] for x in out["logs"]
    )

    fns = reference.learner.fns
    out["base"] = base
    out["reference"] = params_to_flat(fns, ref_state.params["policy"])
    out["version"], out["published"] = final_tensors(multi)
    ps = ParamServer(multi.store)
    out["versions"] = ps.versions()
    out["epoch"] = ps.current_epoch()
    out["manifest_epochs"] = {v: ps.manifest(v)["epoch"] for v in out["versions"]}
    out["train_steps"] = [r["step"] for r in multi.read_metrics("train")]
    out["done"] = json.loads(multi.store.read(DONE_KEY))
    # The checkpoint the two processes wrote, restored here onto one device.
    ckpt = TrainerCheckpoints(multi)
    (params, _), out["ckpt_meta"] = ckpt.restore_latest(reference.learner.template)
    out["restored"] = params_to_flat(fns, params["policy"])
    out["restored_devices"] = {len(x.sharding.device_set) for x in jax.tree.leaves(params)}
    state_dir = local_path(multi.store.url) / "checkpoints" / "2" / "state"
    out["ckpt_writers"] = sorted(p.name for p in state_dir.glob("ocdbt.process_*"))
    return out


def test_two_trainer_processes_form_one_eight_device_mesh_and_exit_0(two_process_trainer):
    r = two_process_trainer
    assert r["codes"] == {"trainer-0": 0, "trainer-1": 0}
    for i, log in enumerate(r["logs"]):
        assert f"process {i}/2 (jax.distributed started), 4 of 8 devices local" in log
        assert "mesh {'data': 1, 'fsdp': 4, 'tensor': 2, 'expert': 1} of 8 devices" in log
        assert "[trainer] step 2/2" in log and "[trainer] done: {'step': 2" in log
    print(f"two-process trainer: {r['seconds']:.1f}s (with the reference run)")


def test_two_process_weights_match_the_one_device_run(two_process_trainer):
    r = two_process_trainer
    assert r["version"] == 2
    assert maxdiff(r["published"], r["base"]) > 1e-5  # the steps moved the weights...
    assert maxdiff(r["published"], r["reference"]) <= 1e-5  # ...as on one device


def test_only_process_zero_takes_the_epoch_and_publishes(two_process_trainer):
    r = two_process_trainer
    # Epoch 1 published v0 in the fixture; one trainer process took epoch 2 (a second
    # acquire would have fenced off the first: exit 3).
    assert r["epoch"] == 2
    assert r["versions"] == [0, 1, 2]
    assert r["manifest_epochs"] == {0: 1, 1: 2, 2: 2}
    assert r["train_steps"] == [1, 2]
    assert r["done"]["step"] == 2 and r["done"]["version"] == 2
    log0, log1 = r["logs"]
    assert "[trainer] epoch 2" in log0
    assert "published v1 (step 1," in log0 and "published v2 (step 2," in log0
    assert "published" not in log1 and "[trainer] epoch" not in log1


def test_checkpoint_of_two_processes_restores_on_one_device(two_process_trainer):
    r = two_process_trainer
    assert r["ckpt_writers"] == ["ocdbt.process_0", "ocdbt.process_1"]
    assert r["ckpt_meta"]["step"] == 2 and r["ckpt_meta"]["epoch"] == 2
    assert r["restored_devices"] == {1}
    assert maxdiff(r["restored"], r["published"]) == 0.0


HELPERS_SCRIPT = r"""
import json
from tpu_jobs.model import mesh as M
assert M.initialize_distributed()  # RLAX_* from the environment
import jax, jax.numpy as jnp, numpy as np, optax

mesh = M.make_mesh((1, 8, 1))  # fsdp over both processes: no process holds a whole weight
rng = np.random.default_rng(0)  # the same values in every process
w = {"layers": {"0": {"mlp": {"down_proj": {"kernel": rng.standard_normal((16, 8), np.float32)}}},
     "norm": {"weight": rng.standard_normal(8, np.float32)}}}
params = M.shard_tree(w, mesh)
opt = M.shard_tree(optax.adamw(1e-3).init(params), mesh)  # Learner.init_state's pattern
again = M.shard_tree(params, mesh)
rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
p = jax.process_index()
local = M.shard_batch(rows[8 * p : 8 * p + 8], mesh, process_local=True)
total = jax.jit(lambda x: jnp.sum(x, axis=0))(local)  # a cross-process reduction
kernel = params["layers"]["0"]["mlp"]["down_proj"]["kernel"]
out = {
    "kernel_local_shape": list(kernel.addressable_shards[0].data.shape),
    "kernel_fully_addressable": kernel.is_fully_addressable,
    "specs": M.describe(params), "opt_specs": M.describe(opt), "again_specs": M.describe(again),
    "params_roundtrip": all(np.array_equal(a, b) for a, b in
                            zip(jax.tree.leaves(M.to_host(again)), jax.tree.leaves(w))),
    "batch_shape": list(local.shape),
    "batch_roundtrip": bool(np.array_equal(M.to_host(local), rows)),
    "sum_equal": bool(np.array_equal(M.to_host(total), rows.sum(0))),
}
print("RESULT" + json.dumps(out), flush=True)
"""


def test_mesh_helpers_on_weights_split_across_two_processes(tmp_path):
    procs = launch([sys.executable, "-c", HELPERS_SCRIPT], tmp_path, "helpers")
    codes = wait_all(procs, timeout=120)
    logs = read_logs(tmp_path, "helpers")
    assert all(c == 0 for c in codes.values()), f"{codes}\n" + "\n----\n".join(logs)
    results = [
        json.loads(next(x for x in log.splitlines() if x.startswith("RESULT"))[len("RESULT") :])
        for log in logs
    ]
    assert results[0] == results[1]
    r = results[0]
    assert r["kernel_local_shape"] == [16, 1] and not r["kernel_fully_addressable"]
    kernel = "layers.0.mlp.down_proj.kernel"
    assert r["specs"][kernel] == str(P("tensor", "fsdp"))  # tensor has size 1 here
    assert r["opt_specs"]["0.mu." + kernel] == r["specs"][kernel]
    assert r["again_specs"] == r["specs"] and r["params_roundtrip"]
    assert r["batch_shape"] == [16, 3] and r["batch_roundtrip"] and r["sum_equal"]
