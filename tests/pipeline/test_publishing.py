"""The trainer's publishing policy (`pipeline.paramserver.publishing.Publisher`) on NumPy
arrays alone: full or delta versions, the delta base in hand or pulled back, retention, and
the repair of damaged versions from each source in turn. This file never imports JAX (the
last test checks that the module's imports do not either)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pipeline.leases import BatchLeases
from pipeline.paramserver import ParamServer, UnrecoverableVersionError
from pipeline.paramserver.adapters import (
    BASE_DIGEST,
    LORA_SCALE,
    BaseMismatchError,
    PolicyReader,
    base_digest,
    server_base_digest,
)
from pipeline.paramserver.publishing import Publisher, PublishPolicy
from pipeline.storage import LocalStore

ROOT = Path(__file__).resolve().parents[2]
POLICY = PublishPolicy(
    dtype="float32",
    parts=1,
    full_every=1,
    publish_every=1,
    keep_versions=0,
    max_staleness=0,
    clock_skew_s=0.0,
)


def split_rows(shapes: Mapping[str, Sequence[int]], parts: int) -> dict[str, int | None]:
    """Matrices cut along their rows, everything else whole (a stand-in for the mesh's
    rules, which need JAX)."""
    return {k: 0 if len(s) == 2 and s[0] % parts == 0 else None for k, s in shapes.items()}


def params(version: int) -> dict[str, np.ndarray]:
    """The trainer's flat float32 parameters at `version`: each version a small step from
    the one before, as training moves them (so deltas are small)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    step = np.float32(1e-3) * np.float32(version)
    return {"w": w + step, "b": b - step, "count": np.array([version], np.int64)}


class Copies:
    """What a trainer holds besides the store (`publishing.HeldCopies`)."""

    checkpoints_url = "file:///run/checkpoints/"

    def __init__(self, version: int, checkpoints: dict[int, dict[str, np.ndarray]]) -> None:
        self.version, self.checkpoints = version, checkpoints
        self.asked: list[str] = []

    def parameters(self) -> dict[str, np.ndarray]:
        self.asked.append("parameters")
        return params(self.version)

    def checkpoint(self, step: int) -> dict[str, np.ndarray] | str:
        self.asked.append(f"checkpoint {step}")
        return self.checkpoints.get(step, f"no checkpoint of step {step}")


def make(tmp_path: Path, **policy) -> tuple[Publisher, list[str]]:
    store = LocalStore(tmp_path / "run")
    lines: list[str] = []
    leases = BatchLeases(store, ttl_seconds=30)
    ps = ParamServer(store, shard_bytes=1024)
    policy = dataclasses.replace(POLICY, **policy)
    return Publisher(ps, leases, policy, split_rows, log=lines.append), lines


def publish_range(pub: Publisher, epoch: int, versions: range) -> None:
    for v in versions:
        pub.publish(v, params(v), epoch=epoch, step=v * pub.policy.publish_every, next_batch=v)


def flip_a_byte(ps: ParamServer, version: int, kind: str) -> None:
    """Corrupt the largest `kind` ("full" or "delta") shard of `version`, behind the store's
    back."""
    folder = Path(ps.store.path_of(f"weights/v{version:08d}"))
    shard = max(folder.glob(f"{kind}-*.bin"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def assert_bits(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype and got[name].tobytes() == ref.tobytes(), name


def test_every_full_every_th_version_is_full_the_others_deltas_and_all_pull_exactly(tmp_path):
    pub, lines = make(tmp_path, full_every=3, parts=2)
    epoch = pub.ps.acquire_epoch()
    publish_range(pub, epoch, range(7))
    kinds = [("full" in m, "delta" in m) for m in map(pub.ps.manifest, range(7))]
    assert kinds == [(True, False)] + [(v % 3 == 0, True) for v in range(1, 7)]
    assert [line.split(" (")[0] for line in lines] == [f"published v{v}" for v in range(7)]
    for v in range(7):
        assert_bits(ParamServer(pub.ps.store).pull(v).tensors, params(v))
    # The matrix is stored in two row blocks, one per tensor rank; the rest whole.
    half = ParamServer(pub.ps.store).pull(6, ranks=frozenset({1}))
    np.testing.assert_array_equal(half.tensors["w"], params(6)["w"][4:])


def test_the_published_dtype_is_bfloat16_rounded_as_ml_dtypes_does(tmp_path):
    pub, _ = make(tmp_path, dtype="bfloat16")
    pub.publish(0, params(0), epoch=pub.ps.acquire_epoch(), step=0, next_batch=0)
    got = pub.ps.pull(0).tensors
    want = params(0)
    for name in ("w", "b"):
        assert got[name].dtype == ml_dtypes.bfloat16
        assert got[name].tobytes() == want[name].astype(ml_dtypes.bfloat16).tobytes()
    assert got["count"].dtype == np.int64  # not floating: as it was


def test_the_snapshot_owns_its_arrays(tmp_path):
    """The trainer's host arrays may view device buffers a later step overwrites: the
    snapshot (the next delta's base) must not change with them."""
    pub, _ = make(tmp_path)
    tensors = params(1)
    snap = pub.snapshot(1, tensors)
    tensors["w"][:] = 0.0
    np.testing.assert_array_equal(snap.tensors["w"], params(1)["w"])


def test_a_restarted_publisher_pulls_its_delta_base_and_an_unusable_one_means_a_full_version(
    tmp_path,
):
    pub, _ = make(tmp_path, full_every=4)
    epoch = pub.ps.acquire_epoch()
    publish_range(pub, epoch, range(3))
    again, lines = make(tmp_path, full_every=4)  # a resumed trainer: nothing in hand
    again.publish(3, params(3), epoch=epoch, step=3, next_batch=3)
    assert "delta" in again.ps.manifest(3) and "full" not in again.ps.manifest(3)
    assert lines == ["published v3 (step 3, delta)"]
    flip_a_byte(again.ps, 3, "delta")  # v3 no longer pulls: v4 cannot be a delta of it
    third, lines = make(tmp_path, full_every=4)
    third.publish(4, params(4), epoch=epoch, step=4, next_batch=4)
    assert lines[0].startswith("v3 unusable as a delta base (")
    assert lines[0].endswith("; full v4")
    assert "full" in third.ps.manifest(4) and "delta" not in third.ps.manifest(4)
    assert_bits(third.ps.pull(4).tensors, params(4))


def test_a_retry_of_a_committed_version_writes_nothing_and_repairs_a_damaged_one(tmp_path):
    pub, _ = make(tmp_path)
    epoch = pub.ps.acquire_epoch()
    publish_range(pub, epoch, range(2))
    again, lines = make(tmp_path)  # a resume publishes its current version again
    assert not again.publish(1, params(1), epoch=epoch, step=1, next_batch=1)
    assert lines == []  # intact: nothing written, nothing to say
    flip_a_byte(again.ps, 1, "full")
    assert not again.publish(1, params(1), epoch=epoch, step=1, next_batch=1)
    [line] = lines
    assert line.startswith("v1 was damaged (") and "from the trainer's parameters" in line
    assert_bits(again.ps.pull(1).tensors, params(1))


# Deltas on (v0 and v4 full), max_staleness=1: a trainer at step 5 still needs v4 and v5.
HEALING = {"full_every": 4, "max_staleness": 1}


def healing_run(tmp_path) -> tuple[Publisher, list[str], int]:
    pub, lines = make(tmp_path, **HEALING)
    epoch = pub.ps.acquire_epoch()
    publish_range(pub, epoch, range(6))
    lines.clear()
    return pub, lines, epoch


def test_heal_lets_go_of_versions_nothing_needs_and_leaves_those_not_reached(tmp_path):
    pub, lines, epoch = healing_run(tmp_path)
    for version in (1, 2, 6):
        pub.ps.report_refused(version, "w0", "flipped")
    assert pub.leases.claim(9, "w1", version=2)  # a live lease still samples from v2
    copies = Copies(5, {})
    pub.heal(step=5, next_batch=6, epoch=epoch, copies=copies)
    # v1: below the oldest pending version (v4) and leased by nobody; v2: leased and intact;
    # v6: above the trainer's v5, for its publish to check.
    assert sorted(pub.ps.refused()) == [6]
    assert lines == ["v1 was reported damaged but is no longer needed"]
    assert copies.asked == []


@pytest.mark.parametrize(
    "version,damage,checkpoints,source,asked",
    [
        (5, "delta", {}, "the trainer's parameters", ["parameters"]),
        (4, "full", {}, "an intact chain of older versions", []),
        (3, "delta", {3: params(3)}, "the checkpoint of step 3", ["checkpoint 3"]),
    ],
)
def test_heal_republishes_a_needed_version_with_its_exact_bits_from_the_first_source(
    version, damage, checkpoints, source, asked, tmp_path
):
    pub, lines, epoch = healing_run(tmp_path)
    flip_a_byte(pub.ps, version, damage)
    pub.ps.report_refused(version, "w0", "crc32c mismatch")
    copies = Copies(5, checkpoints)
    pub.heal(step=5, next_batch=version + 1, epoch=epoch, copies=copies)
    assert copies.asked == asked
    [line] = lines
    assert line.startswith(f"v{version} was damaged (a rollout worker refused it: crc32c")
    assert f"republished it from {source} (same bits;" in line
    assert pub.ps.refused() == {}
    fresh = ParamServer(pub.ps.store)
    for v in range(6):  # the repaired version and every chain through it
        assert_bits(fresh.pull(v).tensors, params(v))
    manifest = fresh.manifest(version)
    assert "full" in manifest and ("delta" in manifest) == (version > 0)
    assert manifest["metadata"]["step"] == version


def test_heal_without_an_exact_copy_stops_with_one_line_naming_what_to_restore(tmp_path):
    pub, _, epoch = healing_run(tmp_path)
    flip_a_byte(pub.ps, 3, "delta")
    pub.ps.report_refused(3, "w0", "crc32c mismatch\nin a shard")
    with pytest.raises(UnrecoverableVersionError) as err:
        pub.heal(step=5, next_batch=4, epoch=epoch, copies=Copies(5, {}))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("weight version v3 is damaged (")
    assert "no checkpoint of step 3; no intact chain of older versions; the trainer holds v5" in (
        message
    )
    assert f"restore {pub.ps.store.url_of('weights/v00000003/')} (or the checkpoint of step 3 " in (
        message
    )
    assert Copies.checkpoints_url in message


def test_retention_after_publish_keeps_the_newest_and_the_pending_versions(tmp_path):
    pub, lines = make(tmp_path, keep_versions=2, publish_every=2, max_staleness=1)
    epoch = pub.ps.acquire_epoch()
    for v in range(6):  # a trainer at step 2v has consumed batches 0 .. 2v - 1
        pub.publish(v, params(v), epoch=epoch, step=2 * v, next_batch=2 * v)
    # Last pass: next_batch=10 pins v4 (10 // 2 - 1) up to v5; the newest two are v4, v5.
    assert pub.ps.versions() == [4, 5]
    assert lines[-1] == "retention deleted v[3], kept v[4, 5]"


# --------------------------------------------------------------------------------------
# LoRA runs: adapter-only versions naming their base (pipeline.paramserver.adapters)
# --------------------------------------------------------------------------------------

SCALE = 2.0  # alpha / rank


def base_tensors(bump: float = 0.0) -> dict[str, np.ndarray]:
    """A base of two target kernels and a norm (the flat names of the model's)."""
    rng = np.random.default_rng(7)
    return {
        "layers.0.self_attn.q_proj.kernel": rng.standard_normal((6, 4)).astype(np.float32),
        "layers.0.mlp.down_proj.kernel": rng.standard_normal((5, 6)).astype(np.float32),
        "norm.weight": np.ones(6, np.float32) + np.float32(bump),
    }


def adapter_tensors(version: int) -> dict[str, np.ndarray]:
    """Rank-2 adapters at `version`: B = 0 at version 0 (the base), then small steps."""
    rng = np.random.default_rng(3)
    step = np.float32(1e-2 * version)
    return {
        "layers.0.self_attn.q_proj.lora_a": rng.standard_normal((6, 2)).astype(np.float32),
        "layers.0.self_attn.q_proj.lora_b": np.full((2, 4), step, np.float32),
        "layers.0.mlp.down_proj.lora_a": rng.standard_normal((5, 2)).astype(np.float32),
        "layers.0.mlp.down_proj.lora_b": np.full((2, 6), -step, np.float32),
    }


def merged_by_hand(version: int) -> dict[str, np.ndarray]:
    """kernel + scale * A @ B in float64, rounded to float32: an independent reference."""
    base, ad = base_tensors(), adapter_tensors(version)
    out = dict(base)
    for module in ("layers.0.self_attn.q_proj", "layers.0.mlp.down_proj"):
        a, b = ad[module + ".lora_a"].astype(np.float64), ad[module + ".lora_b"]
        out[module + ".kernel"] = (base[module + ".kernel"] + SCALE * a @ b).astype(np.float32)
    return out


def make_lora(tmp_path: Path, base: dict[str, np.ndarray] | None = None, **policy):
    """(publisher of a LoRA run, the run's base server) with `base` published as base/ v0."""
    store = LocalStore(tmp_path / "run")
    base_ps = ParamServer(store.child("base/"))
    base_ps.publish(0, base or base_tensors(), epoch=base_ps.acquire_epoch())
    digest = server_base_digest(base_ps)[1]
    lora = {"base_digest": digest, "lora_scale": SCALE}
    pub, _ = make(tmp_path, **lora, **policy)
    return pub, base_ps


def test_the_base_digest_follows_the_bits_not_the_publish(tmp_path):
    """Same tensors published again (another epoch, attempt, time): the same digest; one
    element changed: another."""
    digests = []
    for name, bump, epochs in (("a", 0.0, 1), ("b", 0.0, 3), ("c", 1e-3, 1)):
        ps = ParamServer(LocalStore(tmp_path / name))
        for _ in range(epochs):
            epoch = ps.acquire_epoch()
        ps.publish(0, base_tensors(bump), epoch=epoch)
        digests.append(base_digest(ps.manifest(0)))
    assert digests[0] == digests[1] != digests[2]
    assert all(d.startswith("sha256:") and len(d) == 7 + 64 for d in digests)


def test_adapter_versions_name_their_base_and_workers_merge_them(tmp_path):
    pub, base_ps = make_lora(tmp_path)
    epoch = pub.ps.acquire_epoch()
    for v in range(3):
        pub.publish(v, adapter_tensors(v), epoch=epoch, step=v, next_batch=v)
    reader = PolicyReader(ParamServer(pub.ps.store), base_ps)
    for v in range(3):
        manifest = pub.ps.manifest(v)
        assert manifest["metadata"][BASE_DIGEST] == server_base_digest(base_ps)[1]
        assert manifest["metadata"][LORA_SCALE] == SCALE
        assert sorted(t["name"] for t in manifest["tensors"]) == sorted(adapter_tensors(v))
        got = reader.pull(v, held=v - 1 if v else None).tensors
        want = merged_by_hand(v)
        assert sorted(got) == sorted(want)
        for name in want:  # float32 sums of rank-2 products: a few ulps
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)
    assert_bits(PolicyReader(pub.ps, base_ps).pull(0).tensors, base_tensors())  # v0 = base


def test_a_worker_refuses_adapters_of_another_base_naming_both_digests(tmp_path):
    pub, _ = make_lora(tmp_path)
    pub.publish(0, adapter_tensors(0), epoch=pub.ps.acquire_epoch(), step=0, next_batch=0)
    other = ParamServer(LocalStore(tmp_path / "other"))
    other.publish(0, base_tensors(bump=1.0), epoch=other.acquire_epoch())
    want, have = pub.policy.base_digest, server_base_digest(other)[1]
    with pytest.raises(BaseMismatchError) as err:
        PolicyReader(pub.ps, other).pull(0)
    message = str(err.value)
    assert want in message and have in message and "\n" not in message


def test_delta_versions_work_on_adapters(tmp_path):
    """full_every > 1: adapter versions are stored as deltas like full weights, and a reader
    holding the version before rebuilds the next from its delta alone."""
    pub, base_ps = make_lora(tmp_path, full_every=3)
    epoch = pub.ps.acquire_epoch()
    for v in range(5):
        pub.publish(v, adapter_tensors(v), epoch=epoch, step=v, next_batch=v)
    assert [("delta" in m) for m in map(pub.ps.manifest, range(5))] == [False] + [True] * 4
    reader = PolicyReader(ParamServer(pub.ps.store), base_ps)
    held = None
    for v in range(5):
        snap = reader.pull(v, held=held)
        held = v
        want = merged_by_hand(v)
        for name in want:
            np.testing.assert_allclose(snap.tensors[name], want[name], rtol=1e-6, atol=1e-6)
    assert reader._held.deltas == (4,)  # v4 rebuilt from the held v3 and its delta


def test_retention_deletes_old_adapter_versions_and_never_the_base(tmp_path):
    pub, base_ps = make_lora(tmp_path, keep_versions=1)
    epoch = pub.ps.acquire_epoch()
    for v in range(4):
        pub.publish(v, adapter_tensors(v), epoch=epoch, step=v, next_batch=v)
    assert pub.ps.versions() == [3]
    assert base_ps.versions() == [0]  # base/ is its own server: retention never sees it
    reader = PolicyReader(ParamServer(pub.ps.store), ParamServer(pub.ps.store.child("base/")))
    got = reader.pull(3).tensors
    for name, ref in merged_by_hand(3).items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-6, atol=1e-6)


def test_a_policy_with_a_bad_value_names_it_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"PublishPolicy.dtype='float16' is invalid; allowed: "):
        dataclasses.replace(POLICY, dtype="float16")
    for name in ("parts", "full_every", "publish_every"):
        with pytest.raises(ValueError, match=rf"PublishPolicy.{name}=0 is invalid; allowed: >= 1"):
            dataclasses.replace(POLICY, **{name: 0})
    for name in ("keep_versions", "max_staleness", "clock_skew_s"):
        with pytest.raises(ValueError, match=rf"PublishPolicy.{name}=-1 is invalid; allowed: >= 0"):
            dataclasses.replace(POLICY, **{name: -1})


def test_the_publishing_policy_loads_without_jax():
    """The policy is the parameter server's, on host arrays: importing it (and what this
    file imports) must not pull in JAX, whatever the test process has loaded already."""
    code = (
        "import sys, json\n"
        "import pipeline.paramserver.publishing, tests.pipeline.test_publishing\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('jax', 'jaxlib', 'flax', 'optax', 'tpu_jobs'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []
