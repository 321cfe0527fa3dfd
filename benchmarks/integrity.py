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


T, C, P, H = (
    "tests/tpu_jobs/test_trainer.py::",
    "tests/pipeline/",
    "tests/tpu_jobs/test_preemption.py::",
    "tests/tpu_jobs/test_version_healing.py::",
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
        "a batch from a published version other than the one its index is pinned to "
        "(batch 2 from v0 where required_version is 2)",
        "refused by rule (policy_version must equal required_version(i)), quarantined, "
        "produced again; was accepted by the range check and dropped as stale",
        "nothing; final weights bit-identical to a clean run's",
        T + "test_a_batch_of_the_wrong_version_is_quarantined_and_the_run_ends_bit_identical",
    ),
    Fault(
        "batch_index not its object name, a future, older or mixed policy_version, log-probs of the "
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
        "a weight version the workers still need damaged while the trainer is down (deltas "
        "on, full_every=4, max_staleness=1): bytes flipped in a delta, a delta deleted "
        "mid-chain, bytes flipped in the chain's full snapshot, a truncated manifest",
        "the worker refuses it, leaves a damage report in weights/refused/ and backs off; the "
        "trainer republishes the version with its exact bits (from its checkpoint of that "
        "step, an intact chain of older versions, or its parameters), moving the damaged "
        "objects to weights/quarantine/",
        "nothing: final weights and the repaired version bit-identical to an undamaged run",
        H + "test_a_damaged_version_is_repaired_and_the_run_ends_bit_identical",
    ),
    Fault(
        "a damaged delta whose version has no exact copy left (its checkpoint deleted)",
        "the trainer stops with exit 4 and one line naming the version and what to restore",
        "nothing published wrongly; no silent wait, no traceback",
        H + "test_a_version_without_an_exact_copy_stops_the_run_with_one_line",
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
        "config values that passed and crashed later: model.hidden_size=1e8, task.num_train=1e9, "
        "sampler.max_new_tokens >= model.max_seq_len, eval.ks=[], workers=100000, "
        "`steps: true`",
        "refused at load, naming the field and what is allowed (ceilings: "
        "pipeline.config.MODEL_CEILINGS)",
        "nothing written",
        C + "test_config.py::test_invalid_values_name_field_and_allowed",
    ),
    Fault(
        "a prompt + max_new_tokens longer than model.max_seq_len; an init interrupted "
        "after writing data (another config's)",
        "refused after generation, before anything is written; config.json is written last, "
        "so the corrected retry works and replaces the leftover data",
        "nothing",
        C + "test_config.py::test_init_",
    ),
    Fault(
        "--run gs://b/../x, s3://..., '', file://relative/x, '.', '..'; --logdir under a file; "
        "chaos --kills -3, --workers 0; those config values on the command line; rlax train "
        "without a base model",
        "one line naming the argument and what is allowed, exit 2; nothing written, no epoch taken",
        "nothing",
        C + "test_entrypoint.py::test_refused_in_one_line",
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
        "sandbox service: a POST declaring 10 GB without the token, with a wrong one and "
        "with the right one; Content-Length '1e10' and '-5'; a 1 MB head; a chunked body "
        "past the limit",
        "401/403 on the head alone, the body never read; 413 naming the limit; 400; each "
        "answered and closed in under 1 s; /health and a real run served after",
        "nothing",
        C
        + "test_sandbox_service.py::test_the_token_and_the_size_are_checked_before_a_byte_of_body_is_read",
    ),
    Fault(
        "sandbox service: a head sent one byte at a time (slowloris); a body that stops",
        "closed at the head deadline; 408 at the body deadline; others served meanwhile",
        "nothing",
        C
        + "test_sandbox_service.py::test_slow_heads_and_slow_bodies_are_cut_off_while_others_are_served",
    ),
    Fault(
        "sandbox service: the connection cap + 4 half-open connections; then every connection busy",
        "the oldest half-open ones closed to make room, honest requests served during the "
        "flood, all closed at the head deadline; a newcomer to a busy server closed at once",
        "nothing",
        C
        + "test_sandbox_service.py::test_half_open_connections_are_capped_and_cannot_lock_out_honest_clients",
    ),
    Fault(
        "sandbox service: limits no run can have (processes=100000, open_files=10^7, "
        "run_timeout=3600, memory 1 TiB)",
        "400 naming the field, the value and the service's maximum (--max-limit); a run at "
        "the maximum gets exactly that rlimit",
        "nothing (they used to fail every run with rc 127: a silent reward of 0)",
        C
        + "test_sandbox_service.py::test_limits_above_the_services_maxima_are_refused_naming_field_value_and_maximum",
    ),
    Fault(
        "`rlax sandbox serve --port 99999`, bad --max-limit, --max-body-kb 0, ...",
        "one line naming the argument and what is allowed, exit 2",
        "nothing started",
        C + "test_sandbox_service.py::test_bad_serve_arguments_are_one_line_and_exit_2",
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


def _node_ids(prefixes: list[str]) -> list[str]:
    """The collected test ids that a fault's prefix selects (an id, a file, or the start
    of test names such as `test_config.py::test_init_`, which pytest cannot take as is)."""
    files = sorted({p.split("::")[0] for p in prefixes})
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", *files]
    listed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    return [i for i in ids if any(i == p or i.startswith(p) for p in prefixes)]


def run_tests(faults: list[Fault], xml: Path) -> dict[str, tuple[str, float]]:
    """{test prefix: (passed | failed (n) | missing, seconds)} from one pytest run."""
    ids = sorted({f.test for f in faults})
    # -m "": the listed ids run whatever lane marks them (pyproject's addopts would skip
    # the `integrity` lane's tests).
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", ""]
    cmd += ["-n", "2", "--dist", "loadfile"]  # whole files a worker: module fixtures once
    cmd.append(f"--junitxml={xml}")
    subprocess.run([*cmd, *_node_ids(ids)], cwd=ROOT, check=False)
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
