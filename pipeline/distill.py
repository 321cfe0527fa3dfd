"""On-policy distillation's run-config section (`distill`): which teacher a run learns from.

A run with `distill.teacher` set learns from a teacher's per-token log-probs on its own
samples (`pipeline.teacher` pins and stores the teacher; `tpu_jobs.generate.teacher`
scores the rollouts; the `opd` preset and `trainer.distill_coef` of
`pipeline.algorithms` read the scores).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import check as _check

NAMED_VERSIONS = ("latest", "base")


@dataclass(frozen=True)
class DistillConfig:
    """The teacher of on-policy distillation (module doc).

    teacher: the teacher run's URL ("" = no teacher). Needed exactly when the objective
        reads a teacher (`trainer.algorithm: opd`, or `trainer.distill_coef` > 0).
    teacher_version: "latest", "base", or a version number of that run.
    """

    teacher: str = ""
    teacher_version: str = "latest"

    def __post_init__(self) -> None:
        _check(
            self.teacher_version in NAMED_VERSIONS or self.teacher_version.isdigit(),
            "distill.teacher_version",
            self.teacher_version,
            "latest, base, or a version number (0, 1, ...)",
        )

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)
