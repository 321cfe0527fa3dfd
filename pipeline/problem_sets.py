"""A run's problem sets: the `train` and `eval` (held-out) problems every job reads.

Two sources: synthetic problems generated from the config's task mix (`write_data`), or
the train/validation shards of a Beam curation job written under the run's store
(`write_curated_data`). Both skip work whose output is already there, so a retried task
or a re-run changes nothing. The job role `data` (`pipeline.data_job`) runs either one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pipeline.config import ConfigError, RunConfig
from pipeline.layout import CURATED_PREFIX
from pipeline.parquet_bytes import table_from_bytes
from pipeline.run import CONFIG_KEY, DATA_PREFIX, Run, check_run_url
from pipeline.storage import open_store
from pipeline.tasks import get_task
from pipeline.tasks.base import Problem
from pipeline.tokenizer import TOKENIZERS, Tokenizer, get_tokenizer, unrepresentable


def write_data(run: Run) -> tuple[int, int]:
    """Generate the train/held-out problem sets (skipped if already there)."""
    from pipeline.tasks.mix import build_splits

    if run.has_problems("train") and run.has_problems("eval"):
        return len(run.read_problems("train")), len(run.read_problems("eval"))
    try:
        train, held_out = build_splits(run.config.task)
    except ValueError as err:  # a task option its family cannot generate
        _forget_new_run(run)
        raise ConfigError(f"{err}; run {run.url} was not created") from None
    name = run.config.model.tokenizer
    if name in TOKENIZERS:  # an imported (hf) tokenizer is checked by `rlax import-hf`
        tok = get_tokenizer(name)
        try:
            check_representable([*train, *held_out], tok, name, "generated problems")
            check_fits([*train, *held_out], tok, run.config)
        except ValueError as err:
            _forget_new_run(run)
            raise ConfigError(f"{err}; run {run.url} was not created") from None
    run.write_problems("eval", held_out)
    run.write_problems("train", train)
    return len(train), len(held_out)


def _forget_new_run(run: Run) -> None:
    """Delete the config.json of a run that holds nothing else (just created by a caller
    that wrote it first), so a retry with a fixed config is not "a different config"."""
    if run.store.list("") == [CONFIG_KEY]:
        run.store.delete(CONFIG_KEY)


def init_run(url: str, config: RunConfig) -> tuple[Run, int, int]:
    """Create run `url` with its generated data: (run, train problems, held-out problems).

    config.json is written last, so an init that fails or is interrupted while the data
    is generated leaves no run behind, and its retry (with a fixed config) starts afresh.
    A run that exists already is reopened as `Run.create` does (same config) and its
    missing data generated."""
    check_run_url(url)
    store = open_store(url)
    if store.exists(CONFIG_KEY):
        run = Run.create(url, config)
        return (run, *write_data(run))
    for key in store.list(f"{DATA_PREFIX}/"):  # an interrupted init's, of any config
        store.delete(key)
    n_train, n_eval = write_data(Run(url=url, store=store, config=config))
    return Run.create(url, config), n_train, n_eval


def check_fits(problems: Sequence[Problem], tok: Tokenizer, config: RunConfig) -> None:
    """Refuse problems whose prompt plus the longest completion (`completion_tokens`) does
    not fit in model.max_seq_len: the samplers hold a row in max_seq_len positions."""
    lengths = [len(tok.encode_prompt(p.prompt)) for p in problems]
    longest = max(range(len(problems)), key=lengths.__getitem__)
    n = lengths[longest]
    budget = config.completion_tokens()
    limit = config.model.max_seq_len
    if n + budget > limit:
        field = (
            "environment.max_episode_tokens"
            if config.environment.multi_turn
            else ("sampler.max_new_tokens")
        )
        raise ConfigError(
            f"{field}={budget} is invalid; allowed: <= {limit - n} = model.max_seq_len={limit} "
            f"- {n}, the longest prompt's tokens (problem {problems[longest].problem_id!r})"
        )


def read_curated(store, split: str) -> list[Problem]:
    """Problems of one split of a curated output (`train`/`validation` shards)."""

    problems = []
    for key in store.list(f"{split}/"):
        if key.endswith(".parquet"):
            for row in table_from_bytes(store.read(key)).to_pylist():
                problems.append(Problem.from_dict(row))
    return problems


def check_families(problems: Sequence[Problem], families: Sequence[str], where: str) -> None:
    """Refuse problems of a task family the run has no verifier for, and problems their
    family's verifier cannot score (a code problem with no tests), naming them."""
    unknown = Counter(p.task for p in problems if p.task not in families)
    if unknown:
        raise ValueError(
            f"{where}: {sum(unknown.values())} problems of task families "
            f"{dict(unknown)} have no verifier in this run; allowed families: "
            f"{', '.join(families)} (set task_families / task.families)"
        )
    bad = []
    for p in problems:
        try:
            get_task(p.task).check_problem(p)
        except ValueError as err:
            bad.append(str(err))
    if bad:
        shown = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ValueError(f"{where}: {len(bad)} problems cannot be verified: {shown}")


def check_representable(problems: Sequence[Problem], tok: Tokenizer, name: str, where: str) -> None:
    """Refuse problems whose prompt or answer holds text the run's tokenizer would encode
    as UNK (training would silently lose it), naming the characters and the fix."""
    missing = unrepresentable(tok, [t for p in problems for t in (p.prompt, p.answer)])
    if missing:
        first = next(p for p in problems if set(p.prompt + p.answer) & set(missing))
        raise ValueError(
            f"{where}: the {name} tokenizer (model.tokenizer={name}) cannot represent "
            f"{len(missing)} characters of these problems, {missing[:40]!r} (first in "
            f"problem {first.problem_id!r}), and would turn them into UNK; use "
            "model.tokenizer=byte for a run from scratch (with model.vocab_size >= 260), "
            "or import a pretrained model with its tokenizer (`rlax import-hf`, the DAG's "
            "hf_checkpoint param, model.tokenizer=hf)"
        )


def write_curated_data(
    run: Run, curated_prefix: str = CURATED_PREFIX, eval_from: Sequence[Problem] | None = None
) -> tuple[int, int]:
    """Make a curated output (under the run's store) the run's train/eval problem sets.

    The held-out set is the curated validation split, or `eval_from` (a list of
    Problems, e.g. a parent run's held-out set, so versions stay comparable)."""
    if run.has_problems("train") and run.has_problems("eval"):
        return len(run.read_problems("train")), len(run.read_problems("eval"))
    curated = run.store.child(curated_prefix)
    families = run.config.task.families
    train = read_curated(curated, "train")
    held_out = list(eval_from) if eval_from is not None else read_curated(curated, "validation")
    if not train or not held_out:
        raise ValueError(
            f"curated data under {curated.url} has {len(train)} train and {len(held_out)} "
            "held-out problems; both must be non-empty (more source rows, or a larger "
            "--val-fraction)"
        )
    check_families(train, families, "curated train split")
    check_families(held_out, families, "held-out set")
    name = run.config.model.tokenizer
    if name in TOKENIZERS:  # an HF tokenizer is checked once imported (`rlax import-hf`)
        for split, problems in (("curated train split", train), ("held-out set", held_out)):
            check_representable(problems, get_tokenizer(name), name, split)
    eval_ids = {p.problem_id for p in held_out}
    train = [p for p in train if p.problem_id not in eval_ids]
    run.write_problems("eval", held_out)
    run.write_problems("train", train)
    return len(train), len(held_out)
