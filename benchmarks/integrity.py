"""Integrity under bad data, corrupted state and signals: each fault tried, what happened,
what was lost. Every row is a real test of the suite (it plants the fault on real runs and
processes and asserts the outcome); this script runs them and writes the table with each
test's result, so the table cannot claim more than the tests showed.

    python benchmarks/integrity.py            # -> benchmarks/results/integrity.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "integrity.md"


@dataclass(frozen=True)
class Fault:
    fault: str
    happened: str
    lost: str
    test: str  # a pytest node id (a prefix selects all its parametrisations)


T, C, P = (
    "tests/tpu_jobs/test_trainer.py::",
    "tests/pipeline/",
    "tests/tpu_jobs/test_preemption.py::",
)
FAULTS = [
    Fault(
        "a NaN reward, an infinite reward, token id 10^6, token id -5 (one per batch)",
        "each batch refused, moved to quarantine/ with its reason, produced again; 4 of 4 "
        "steps trained on the good batches",
        "nothing (the refused bytes are kept in quarantine/); every published version finite",
        T + "test_poisoned_batches_are_quarantined_and_the_run_goes_on",
    ),
    Fault(
        "batch_index not its object name, a future or mixed policy_version, log-probs of the "
        "wrong length, NaN or positive, a too-long completion, groups out of order, an "
        "unknown kind, a column of the wrong type, garbage bytes, a 0-row batch, too many rows",
        "refused with the column and row named",
        "nothing",
        C + "test_batch_checks.py",
    ),
    Fault(
        "a batch that passes the checks yet gives NaN gradients (single update, fused step, "
        "4 updates per batch)",
        "the update is skipped inside the program: parameters and optimizer state bit for bit "
        "unchanged; the trainer quarantines the batch and trains on it when it is produced again",
        "nothing; no non-finite value published or checkpointed",
        T + "test_the_finite_guard_skips_a_non_finite_update_and_keeps_the_state",
    ),
    Fault(
        "non-finite gradients in the trainer process",
        "step skipped and recorded (nonfinite_steps), batch quarantined and redone",
        "nothing; versions v0..v2 all finite",
        T + "test_a_non_finite_step_is_skipped_quarantined_and_never_published",
    ),
    Fault(
        "a worker that writes the same bad batch again and again",
        "after 3 refusals in a row the trainer stops (exit 4) naming the batch, the reason and "
        "where the copies are",
        "nothing published beyond v0; the run resumes from its checkpoint once fixed",
        T + "test_a_batch_refused_again_and_again_stops_the_trainer_with_a_clear_error",
    ),
    Fault(
        "4 flipped bytes in each kind of checkpoint file (array data, OCDBT manifest, array "
        "metadata, JSON meta, step metadata)",
        "that step refused (its file named, sizes and CRC32C given), the previous one restored",
        "the steps since the previous checkpoint, recomputed",
        P + "test_a_checkpoint_with_flipped_bytes_is_refused_for_the_previous_one",
    ),
    Fault(
        "4 flipped bytes in the newest checkpoint's array data, then the trainer restarted",
        "resumed from step 4 instead of 6, replayed the same batches",
        "2 steps recomputed; final weights bit-identical to the uninterrupted run",
        P + "test_the_trainer_resumes_from_the_last_good_checkpoint_and_ends_bit_identical",
    ),
    Fault(
        "every checkpoint bad (one changed, one without its manifest)",
        "the trainer stops with an error naming each step and why",
        "nothing restored wrongly; the run is not silently restarted from the base",
        P + "test_every_checkpoint_refused_is_an_error_naming_each",
    ),
    Fault(
        "a published shard with a flipped byte; LATEST naming a version whose manifest is gone",
        "the worker refuses it and leaves a marker; the trainer rewrites that version from its "
        "parameters (same bits); the worker loads it",
        "nothing",
        T + "test_a_version_a_worker_refuses_is_reported_and_rewritten_by_the_trainer",
    ),
    Fault(
        "SIGKILL or SIGTERM of `rlax rollout`",
        "the worker stops: PR_SET_PDEATHSIG (kill -9) or the forwarded signal",
        "nothing (an unfinished batch's lease expires and it is redone)",
        C + "test_launcher.py::test_stopping_rlax_rollout_stops_its_worker",
    ),
    Fault(
        "SIGKILL of a parent whose child has children (how `rlax airflow` holds Airflow)",
        "the watchdog sidecar stops the child's whole process group",
        "nothing left running",
        C
        + "test_launcher.py::test_the_watchdog_stops_a_childs_whole_group_when_the_parent_is_killed",
    ),
    Fault(
        "one bad value in each of the config's numeric fields (vocab_size=10, rope_theta=-1, "
        "lr=.inf, negative weight decay and warm-up, eval.batch_size=0, poll_seconds=-1, "
        "lease_seconds=.inf, ...)",
        "refused, naming the field and what is allowed",
        "nothing written",
        C + "test_config.py::test_each_numeric_field_refuses_a_value_outside_its_range",
    ),
    Fault(
        "a config that fails while its data is generated (task.max_digits=30)",
        "one-line config error; config.json removed, so the retry with a fixed config works",
        "nothing",
        C + "test_config.py::test_a_failed_init_leaves_nothing_behind",
    ),
    Fault(
        "bad YAML; unreachable storage",
        "one line naming the line and column / what to check (exit 2); --debug shows the traceback",
        "nothing",
        C + "test_entrypoint.py",
    ),
    Fault(
        "run_id '..', '../outside', '/abs/dir'; storage_root with '..'; config_file outside",
        "refused by the trigger form and again by the tasks",
        "nothing created",
        "tests/dags/test_dagbag.py::test_params_have_types_descriptions_and_validate",
    ),
    Fault(
        "docker-compose default JWT/API secrets and admin password",
        "none shipped; compose refuses to start without docker/.env (docker/new_env.py)",
        "n/a",
        "tests/dags/test_compose.py::test_compose_ships_no_default_secrets",
    ),
    Fault(
        "a code completion that forges its reward: walks sys._getframe() into the harness, "
        "returns an always-equal object or an int subclass equal to everything, prints the "
        "harness's marker, sys.exit(0) / os._exit(0), searches memory and fds for the tests, "
        "kills the harness, writes a reply frame of its own",
        "each scores 0 (the tests run in a harness process the program cannot reach; only "
        "plain data crosses; only the harness writes the verdict); the honest program beside "
        "each scores 1",
        "nothing",
        C + "test_code_task.py::test_forged_rewards_score_zero",
    ),
    Fault(
        "HumanEval's 164 canonical solutions through the separated harness",
        "164 of 164 pass (whole programs and fenced), as before",
        "nothing",
        C + "test_code_task.py::test_all_164_canonical_solutions_pass",
    ),
    Fault(
        "a program that redefines a helper the tests call (HumanEval/32's poly)",
        "the tests use the dataset prefix's helper, run in the harness: the cheat scores 0",
        "nothing",
        C + "test_code_task.py::test_the_tests_use_the_prefixs_helpers_not_the_programs",
    ),
    Fault(
        "math answers carrying Python (__import__, lambda) in \\boxed{}, \\text{} and plain text",
        "parsed, never run: the payload's side effect never happens, reward 0",
        "nothing",
        C + "test_math_task.py::test_model_text_is_parsed_never_run_by_the_grader",
    ),
    Fault(
        "a run leaves a SysV shared-memory segment, a queued message, a semaphore, POSIX "
        "shared memory and a named semaphore, and tries a POSIX message queue",
        "the next run in the same worker finds none of them (SysV objects removed after "
        "every run, /dev/shm emptied, message queues refused by RLIMIT_MSGQUEUE=0)",
        "nothing",
        C + "test_sandbox.py::test_no_ipc_object_outlives_the_run",
    ),
    Fault(
        "a tool program keeping counters in SysV and POSIX shared memory, called 8 times",
        "prints 1 1 every time, whichever worker ran the earlier calls",
        "nothing",
        C
        + "test_environments.py::test_a_tool_call_prints_the_same_whichever_worker_ran_earlier_calls",
    ),
    Fault(
        "random SIGKILLs of the trainer and workers (chaos)",
        "the schedule kills the trainer after its first checkpoint and a worker mid-batch; "
        "a run without both and a restore is reported inconclusive",
        "no batch lost or produced twice; final weights bit-identical",
        P + "test_small_chaos_run",
    ),
]


def run_tests(faults: list[Fault], xml: Path) -> dict[str, tuple[str, float]]:
    """{test prefix: (passed | failed (n) | missing, seconds)} from one pytest run."""
    ids = sorted({f.test for f in faults})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    subprocess.run([*cmd, *ids], cwd=ROOT, check=False)
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        failed = any(child.tag in ("failure", "error") for child in case)
        cases.append((f"{path}::{case.get('name')}", failed, float(case.get("time", 0))))
    out = {}
    for test in ids:
        mine = [c for c in cases if c[0] == test or c[0].startswith(test)]
        bad = sum(1 for c in mine if c[1])
        state = "missing" if not mine else (f"FAILED ({bad} of {len(mine)})" if bad else "passed")
        out[test] = (f"{state} ({len(mine)} case{'s' * (len(mine) != 1)})", sum(c[2] for c in mine))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    t0 = time.time()
    results = run_tests(FAULTS, args.out.with_suffix(".xml"))
    lines = [
        "# Integrity: faults tried, what happened, what was lost",
        "",
        f"`python benchmarks/integrity.py`, {time.strftime('%Y-%m-%d')}, "
        f"{time.time() - t0:.0f} s. Each row is a test of the suite that plants the fault on "
        "real runs and processes and asserts the outcome; its result is this run's.",
        "",
        "| fault | what happened | what was lost | test | result |",
        "|---|---|---|---|---|",
    ]
    for f in FAULTS:
        state, secs = results[f.test]
        lines.append(
            f"| {f.fault} | {f.happened} | {f.lost} | `{f.test}` | {state}, {secs:.0f} s |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".xml").unlink(missing_ok=True)
    print("\n".join(lines))
    return 0 if all(r[0].startswith("passed") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
