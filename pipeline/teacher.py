"""On-policy distillation's teacher, pinned and stored under the run.

A run with `distill.teacher` set learns from a teacher's per-token log-probs on its own
samples: the rollout worker scores every sampled token with the teacher
(`tpu_jobs.generate.teacher`) and writes the log-probs into the batch
(`pipeline.rollouts`, `teacher_logprobs`); the `opd` preset's advantage is
-(log pi_old - log pi_teacher), and `trainer.distill_coef` mixes it into an RL preset's
(`pipeline.algorithms`).

The teacher is a snapshot of another run: `distill.teacher_version` "latest" (that run's
newest version when the teacher is pinned), "base" (its base: an HF checkpoint imported
with `rlax import-hf PATH --run URL`, or its SFT base), or a version number. The first job
of the run that needs it (a rollout worker, `pin_teacher`) resolves that
once and stores the teacher under the run, as the base is stored:

    teacher/pin.json             {"run", "version", "digest", "tokenizer", ...}, create-only
    teacher/config.json          the teacher run's config (its model's shape)
    teacher/weights/v00000000/   the snapshot (a LoRA teacher's adapters merged)

Later jobs, retries and resumes read the pin, never the teacher run's "latest" again, so a
run's teacher cannot change under it; the copy is checked against the pinned digest and its
shards' checksums when it is loaded (`check_copy`), and a deleted copy is copied again at
the pinned version. A teacher must encode text as the student does: the same `model.tokenizer`, and
for an imported tokenizer the same tokenizer.json bytes. Anything else is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline import failpoints
from pipeline.errors import ConfigError
from pipeline.layout import BASE_PREFIX, CONFIG_KEY, HF_PREFIX

if TYPE_CHECKING:
    from pipeline.paramserver import ParamServer
    from pipeline.run import Run

TEACHER_PREFIX = "teacher"
PIN_KEY = f"{TEACHER_PREFIX}/pin.json"
TEACHER_CONFIG_KEY = f"{TEACHER_PREFIX}/{CONFIG_KEY}"
# Create-only: the job that copies the teacher (`_claim_copy`); the others wait for it.
COPY_CLAIM_KEY = f"{TEACHER_PREFIX}/copying.json"
# An imported (hf) tokenizer, as `rlax import-hf` stores it with the run's base.
HF_TOKENIZER_KEY = f"{BASE_PREFIX}/{HF_PREFIX}/tokenizer.json"


class TeacherError(ConfigError):
    """The configured teacher cannot be pinned or loaded (a missing run or version, another
    tokenizer, a damaged copy): bad input, so jobs fail fast instead of retrying; the
    message says what and how to fix it."""


@dataclass(frozen=True)
class TeacherPin:
    """What a run distils from, as pinned in `teacher/pin.json`."""

    run: str  # the teacher run's URL
    version: int | str  # its version number, or "base"
    digest: str  # `pipeline.paramserver.adapters.base_digest` of the snapshot

    def describe(self) -> str:
        where = "base" if self.version == "base" else f"v{self.version}"
        return f"{self.run} @ {where} ({self.digest[:19]})"


def teacher_server(run: Run) -> ParamServer:
    """The run's pinned teacher: version 0 of a parameter server under `teacher/`."""
    from pipeline.paramserver import ParamServer

    return ParamServer(run.store.child(TEACHER_PREFIX))


def read_pin(run: Run) -> TeacherPin | None:
    """The run's pinned teacher, or None before it is pinned."""
    if not run.store.exists(PIN_KEY):
        return None
    record = json.loads(run.store.read(PIN_KEY))
    return TeacherPin(record["run"], record["version"], record["digest"])


def tokenizer_identity(run: Run) -> dict[str, Any]:
    """How `run` encodes text: its tokenizer's name and, for an imported (hf) tokenizer,
    the sha256 of its tokenizer.json."""
    name = run.config.model.tokenizer
    out: dict[str, Any] = {"name": name}
    if name == "hf":
        if not run.store.exists(HF_TOKENIZER_KEY):
            raise TeacherError(f"{run.url} has model.tokenizer=hf but no {HF_TOKENIZER_KEY}")
        out["sha256"] = hashlib.sha256(run.store.read(HF_TOKENIZER_KEY)).hexdigest()
    return out


def _describe(run: Run, identity: dict[str, Any]) -> str:
    """`identity` (tokenizer_identity of `run`) as a person would check it: the setting
    and, for an imported tokenizer, the file and its sha256."""
    text = f"model.tokenizer={identity['name']}"
    if "sha256" in identity:
        text += f" ({run.url.rstrip('/')}/{HF_TOKENIZER_KEY}, sha256 {identity['sha256']})"
    return text


def _resolve(teacher: Run, version: str) -> tuple[ParamServer, int | str, int]:
    """(server, pinned version, version on that server) of `version` in `teacher`."""
    from pipeline.run import base_server, weights_server

    if version == "base":
        server = base_server(teacher)
        found = server.latest_version()
        if found is None:
            raise TeacherError(
                f"teacher run {teacher.url} has no base snapshot yet (run its SFT, or "
                f"`rlax import-hf PATH --run {teacher.url}`)"
            )
        return server, "base", found
    server = weights_server(teacher)
    published = server.versions()
    if version == "latest":
        if not published:
            raise TeacherError(
                f"teacher run {teacher.url} has published no version yet; train it first "
                "or set distill.teacher_version=base"
            )
        return server, max(published), max(published)
    if int(version) not in published:
        raise TeacherError(
            f"teacher run {teacher.url} has no version {int(version)}; published: "
            + (", ".join(map(str, sorted(published)[-10:])) or "none")
            + " (or distill.teacher_version=latest / base)"
        )
    return server, int(version), int(version)


def pin_teacher(run: Run, *, owner: str = "", wait_s: float = 600.0) -> TeacherPin:
    """The run's teacher, copied under the run and pinned the first time (module doc).

    Safe to call from every job at once: one job claims the copy (`owner` names it, e.g. a
    worker id, so its restart resumes the claim), the others wait for it; the copy is
    version 0 of the run's teacher server (create-only, one writer epoch wins), and the
    pin is written from that copy's manifest, so every caller pins the snapshot copied."""
    from pipeline.paramserver import StaleEpochError
    from pipeline.paramserver.adapters import base_digest

    cfg = run.config.distill
    if not cfg.enabled:
        raise ConfigError("distill.teacher is empty: this run has no teacher")
    pin = read_pin(run)
    server = teacher_server(run)
    if not server.versions():
        # First use, or a damaged copy deleted to be copied again (`check_copy`): a pinned
        # teacher is copied at its pinned version, never re-resolved, so it cannot move.
        src = _source(run, cfg.teacher_version if pin is None else str(pin.version))
        if _claim_copy(run, server, owner, wait_s):
            try:
                _copy_teacher(run, server, src)
                # Killed here, the copy is committed and the pin is not: the next job pins.
                failpoints.hit("teacher.before_pin")
            except StaleEpochError:
                # A job that took over a stale claim copies it now: wait for its version 0.
                _wait_for_copy(run, server, wait_s)
    if pin is not None:
        return pin
    manifest = server.manifest(0)
    meta = manifest.get("metadata") or {}
    record = {
        "run": meta["run"],
        "version": meta["version"],
        "digest": base_digest(manifest),
        "tokenizer": meta["tokenizer"],
        "requested": cfg.teacher_version,
    }
    run.store.write_new(PIN_KEY, json.dumps(record, sort_keys=True).encode())
    pin = read_pin(run)
    assert pin is not None
    return pin


def _claim_copy(run: Run, server: ParamServer, owner: str, wait_s: float) -> bool:
    """Whether this job copies the teacher: the first to create the claim does, and the
    others wait for its version 0 (so N workers starting together upload one copy, not N).
    The claimant's restart (the same `owner`) resumes at once; a claim older than `wait_s`
    whose copy never came (its job died for good) is taken over. The copy's writer epoch
    fences any two that race."""
    if not owner:  # an anonymous caller (a one-off, a test) copies without a claim
        return True
    claim = json.dumps({"at": time.time(), "owner": owner}).encode()
    if run.store.write_new(COPY_CLAIM_KEY, claim):
        return True
    held = json.loads(run.store.read(COPY_CLAIM_KEY))
    if held.get("owner") == owner:
        return True
    return not _wait_for_copy(run, server, held["at"] + wait_s - time.time())


def _wait_for_copy(run: Run, server: ParamServer, wait_s: float) -> bool:
    """Wait up to `wait_s` for the teacher copy's version 0; whether it came."""
    deadline = time.monotonic() + max(0.0, wait_s)
    while not server.versions():
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return True


@dataclass(frozen=True)
class _Source:
    """The configured teacher, checked and resolved: its run, the snapshot's server, the
    pinned version ("base" or a number) and the version on that server."""

    run: Run
    server: ParamServer
    version: int | str
    on_server: int
    tokenizer: dict[str, Any]


def _source(run: Run, requested: str) -> _Source:
    """Open the configured teacher, check its tokenizer, resolve version `requested`
    (cheap reads, before any job claims the copy: a refusal leaves no claim behind)."""
    from pipeline.run import Run, RunError

    cfg = run.config.distill
    try:
        teacher = Run.open(cfg.teacher)
    except RunError as err:
        raise TeacherError(f"distill.teacher={cfg.teacher!r}: {err}") from None
    mine, theirs = tokenizer_identity(run), tokenizer_identity(teacher)
    if mine != theirs:
        raise TeacherError(
            f"the teacher {cfg.teacher} encodes text with {_describe(teacher, theirs)}, "
            f"this run with {_describe(run, mine)}; a teacher must share the student's "
            "tokenizer (it scores the student's token ids)"
        )
    server, version, on_server = _resolve(teacher, requested)
    return _Source(teacher, server, version, on_server, theirs)


def _copy_teacher(run: Run, server: ParamServer, src: _Source) -> None:
    """Publish the teacher `src` as `server`'s version 0 (its config next to it)."""
    from pipeline.run import policy_reader

    teacher = src.run
    if src.version == "base":
        snap = src.server.pull(src.on_server)
    else:  # the teacher as it samples: a LoRA teacher's adapters merged into its base
        snap = policy_reader(teacher).pull(src.on_server)
    run.store.write_new(TEACHER_CONFIG_KEY, teacher.store.read(CONFIG_KEY))  # kept on a re-copy
    # Killed here, the config is there without the weights: the next job copies both (the
    # config's create-only write then finds the same bytes).
    failpoints.hit("teacher.before_publish")
    meta = {"source": "teacher", "run": teacher.url, "version": src.version}
    server.publish(
        0,
        dict(snap.tensors),
        epoch=server.acquire_epoch(),
        metadata={**meta, "tokenizer": src.tokenizer},
    )


def teacher_config(run: Run) -> Any:
    """The pinned teacher run's `RunConfig` (its `model` is the teacher's shape)."""
    from pipeline.config import config_from_json

    return config_from_json(run.store.read(TEACHER_CONFIG_KEY).decode())


def check_copy(run: Run, pin: TeacherPin) -> dict[str, Any]:
    """The tensors of the run's teacher copy, verified to be the pinned snapshot: its
    manifest's digest is the pin's and every shard's bytes match the manifest's crc32c.
    TeacherError (saying how to repair it) otherwise."""
    from pipeline.paramserver import CorruptSnapshotError, SnapshotNotFoundError
    from pipeline.paramserver.adapters import base_digest

    server = teacher_server(run)
    repair = (
        f"delete {run.url}/{TEACHER_PREFIX}/weights and the next job copies {pin.describe()} again"
    )
    try:
        got = base_digest(server.manifest(0))
        if got != pin.digest:
            raise TeacherError(
                f"the teacher copy under {run.url}/{TEACHER_PREFIX} has digest {got[:19]}, "
                f"but {pin.describe()} is pinned; {repair}"
            )
        return dict(server.pull(0).tensors)
    except (CorruptSnapshotError, SnapshotNotFoundError) as err:
        raise TeacherError(
            f"the teacher copy under {run.url}/{TEACHER_PREFIX} is damaged ({err}); {repair}"
        ) from None
