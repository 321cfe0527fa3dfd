import dataclasses
import json
from dataclasses import fields
from pathlib import Path

import pytest

from pipeline.algorithms import PARAM_TYPES
from pipeline.config import (
    ConfigError,
    ModelConfig,
    RunConfig,
    TrainerConfig,
    config_from_json,
    legacy_digest,
    load_config,
    migrate,
    parse_overrides,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["demo", "tiny"])
def test_shipped_configs_load(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert isinstance(cfg, RunConfig)
    assert cfg.model.preset == name
    assert cfg.model.head_dim * cfg.model.num_heads == cfg.model.hidden_size


def test_dotted_overrides_are_typed():
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [
            "trainer.lr=3e-4",
            "task.families=arithmetic",
            "task.weights=[1.0]",
            "model.qkv_bias=true",
            "eval.ks=1,2",
        ],
    )
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.task.families == ("arithmetic",)
    assert cfg.model.qkv_bias is True
    assert cfg.eval.ks == (1, 2)


def test_mesh_section_from_yaml_and_overrides(tmp_path):
    assert load_config(None).mesh.trainer is None  # default: one device, no sharding
    path = tmp_path / "mesh.yaml"
    path.write_text("mesh:\n  trainer: [1, -1, 2]\n  sampler: [-1, 1, 1]\n  distributed: true\n")
    cfg = load_config(path, ["mesh.trainer=[2,2,2]"])
    assert cfg.mesh.trainer == (2, 2, 2) and cfg.mesh.sampler == (-1, 1, 1)
    assert cfg.mesh.distributed is True
    assert load_config(None, ["mesh.sampler=-1,1,1"]).mesh.sampler == (-1, 1, 1)
    assert load_config(path, ["mesh.trainer=null"]).mesh.trainer is None
    again = config_from_json(json.dumps(cfg.to_dict()))  # the run's stored config.json
    assert again == cfg and again.digest() == cfg.digest()


def test_preset_fills_sizes_and_explicit_value_wins():
    cfg = load_config(None, ["model.preset=demo", "model.num_layers=5"])
    assert cfg.model.hidden_size == 128 and cfg.model.num_layers == 5


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.algorithm=ppo9", ["trainer.algorithm", "'grpo'"]),
        ("model.preset=huge", ["model.preset", "'tiny'", "'demo'", "'100m'"]),
        ("task.families=[sudoku]", ["task.families", "'arithmetic'"]),
        ("trainer.lr=-1", ["trainer.lr", "> 0"]),
        ("trainer.lr=fast", ["trainer.lr", "float"]),
        ("trainer.bogus=1", ["trainer.bogus", "allowed", "lr"]),
        ("sampler.top_p=1.5", ["sampler.top_p", "(0, 1]"]),
        ("sampler.engine=sglang", ["sampler.engine", "'jax', 'static', 'vllm'"]),
        (
            "sampler.engine=vllm",
            ["sampler.engine='vllm'", "trainer.is_correction='none'", "is_correction=tis"],
        ),
        ("model.num_kv_heads=3", ["model.num_kv_heads", "divisor"]),
        ("eval.ks=[1,16]", ["eval.ks", "num_samples=8"]),
        ("mesh.trainer=[2,2]", ["mesh.trainer", "4 sizes", "or 3: expert = 1"]),
        ("mesh.sampler=[-1,-1,1]", ["mesh.sampler", "at most one"]),
        ("mesh.trainer=[0,1,1]", ["mesh.trainer", ">= 1 or -1"]),
        ("model.tokenizer=bpe", ["model.tokenizer", "'char'", "'byte'", "'hf'"]),
        ("sandbox.url=ftp://host:21", ["sandbox.url", "http://host:port"]),
        ("sandbox.url=http://host", ["sandbox.url", "http://host:port"]),
        ("sandbox.url=http://host:8080/run_code", ["sandbox.url", "nothing after it"]),
        ("sandbox.url=http://host:99999", ["sandbox.url", "http://host:port"]),
        ("sandbox.token_env=MY-TOKEN", ["sandbox.token_env", "environment variable name"]),
        ("nonsense", ["section.field=value"]),
        # Issue 35, item 6: values that passed and then crashed a job, or ran for minutes.
        ("model.hidden_size=100000000", ["model.hidden_size", "1..32768", "MODEL_CEILINGS"]),
        ("model.vocab_size=1073741824", ["model.vocab_size", "1..1048576"]),
        ("sampler.max_new_tokens=256", ["sampler.max_new_tokens", "< model.max_seq_len=256"]),
        ("task.num_train=1000000000", ["task.num_train", "1..1000000"]),
        ("eval.ks=[]", ["eval.ks", "a non-empty list"]),
        ("workers=100000", ["workers", "1..1024"]),
        ("trainer.steps=true", ["trainer.steps=True", "an integer, not true or false"]),
        ("trainer.lr=false", ["trainer.lr=False", "a number, not true or false"]),
    ],
)
def test_invalid_values_name_field_and_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/demo.yaml", [override])
    for w in words:
        assert w in str(err.value)


def test_vllm_engine_needs_recomputed_old_logprobs_with_tis_and_no_sampler_mesh():
    ok = ["sampler.engine=vllm", "trainer.is_correction=tis"]
    cfg = load_config(ROOT / "configs/demo.yaml", [*ok, "sampler.vllm_args=[--enforce-eager]"])
    assert cfg.sampler.vllm_args == ("--enforce-eager",)
    load_config(ROOT / "configs/demo.yaml", ["sampler.engine=vllm", "trainer.is_correction=mis"])
    with pytest.raises(ConfigError, match="old_logprobs='behaviour'.*allowed: trainer.old_log"):
        load_config(ROOT / "configs/demo.yaml", [*ok, "trainer.old_logprobs=behaviour"])
    with pytest.raises(ConfigError, match="mesh.sampler.*tensor-parallel-size"):
        load_config(ROOT / "configs/demo.yaml", [*ok, "mesh.sampler=[-1,1,1]"])


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_digest_changes_with_any_field():
    a = load_config(None)
    b = load_config(None, ["trainer.lr=1e-3"])
    assert a.digest() == load_config(None).digest()
    assert a.digest() != b.digest()


def test_parse_overrides_nested():
    assert parse_overrides(["a.b=1", "a.c=x", "d=2.5"]) == {"a": {"b": 1, "c": "x"}, "d": 2.5}


# Every numeric field with one value outside its range (the probe's finding 4: vocab_size=10,
# rope_theta=-1, lr=.inf, negative weight decay and warm-up, eval.batch_size=0,
# poll_seconds=-1, lease_seconds=.inf were all accepted). A field added without an entry
# here fails `test_every_numeric_field_has_a_bad_value_in_the_table`.
BAD_VALUES = {
    "seed": -1,
    "workers": 0,
    "model.vocab_size": 10,  # below the char tokenizer's 59 ids
    "model.hidden_size": -8,
    "model.num_layers": -1,
    "model.num_heads": -4,
    "model.num_kv_heads": 3,  # not a divisor of num_heads=4
    "model.head_dim": -2,
    "model.intermediate_size": -64,
    "model.rope_theta": -1,
    "model.rms_norm_eps": 0,
    "model.max_seq_len": 0,
    "model.logits_chunk": -1,
    "model.remat": "some",
    "model.attention": "flash",
    "model.attention_chunk": 0,
    "model.num_experts": -1,
    "model.num_experts_per_tok": 2,  # on a dense model (num_experts=0)
    "model.moe_intermediate_size": -8,
    "model.shared_expert_intermediate_size": -8,
    "model.router_aux_loss_coef": -0.001,
    "model.router_z_loss_coef": ".nan",
    "task.seed": -3,
    "task.num_train": 0,
    "task.num_eval": 0,
    "task.arithmetic.min_digits": 0,
    "task.arithmetic.max_digits": 0,  # below min_digits
    "task.countdown.numbers": 9,
    "task.weights": "[-1, 1]",
    "rollout.sample_chunks": 0,
    "rollout.inflight_batches": 0,
    "sft.steps": -1,
    "sft.batch_size": 0,
    "sft.lr": ".inf",
    "sft.warmup_steps": -1,
    "sft.weight_decay": -0.1,
    "sft.target_loss": ".nan",
    "sft.check_every": 0,
    "task.arithmetic.carry_drop_prob": 1.0,
    "task.countdown.error_prob": -0.5,
    "task.long_multiplication.digits": 1,
    "task.long_multiplication.tool_prob": 1.5,
    "task.long_multiplication.digit_error_prob": 1.0,
    "task.code.max_ops": 3,
    "task.code.min_ops": 0,
    "task.code.max_const": 1,
    "task.code.examples": 3,
    "task.code.tests": 0,
    "task.code.error_prob": 1.0,
    "sft.judge_fraction": 2,
    "sampler.temperature": -1,
    "sampler.top_k": -1,
    "sampler.top_p": 0,
    "sampler.max_new_tokens": 0,
    "sampler.kv_token_budget": -1,
    "sampler.slots": 0,
    "sampler.page_size": 0,
    "sampler.decode_chunk": 0,
    "trainer.steps": -1,
    "trainer.lr": ".inf",
    "trainer.warmup_steps": -5,
    "trainer.weight_decay": -0.01,
    "trainer.grad_clip": 0,
    "trainer.clip_eps": 1.5,
    "trainer.eps_low": 2,
    "trainer.eps_high": -1,
    "trainer.dual_clip": 0.5,
    "trainer.kl_coef": -1,
    "trainer.reward_kl_coef": -1,
    "trainer.entropy_coef": -1,
    "trainer.adv_eps": 0,
    "trainer.gamma": 2,
    "trainer.lam": -0.1,
    "trainer.max_len": -1,
    "trainer.vf_coef": -1,
    "trainer.value_clip": 0,
    "trainer.is_cap": 0.5,
    "trainer.distill_coef": -0.5,
    "distill.teacher_version": "v3",  # "latest", "base" or a number
    "trainer.mini_batches": 0,
    "trainer.epochs": 0,
    "trainer.value_lr_mult": 0,
    "trainer.dynamic_sampling_rounds": 0,
    "trainer.overlong_buffer": -1,
    "trainer.publish_every": 0,
    "trainer.checkpoint_every": 0,
    "trainer.keep_checkpoints": 0,
    "trainer.keep_versions": -1,
    "trainer.max_staleness": -1,
    "trainer.micro_batch": -1,
    "trainer.judge_loss_weight": -0.1,
    "trainer.max_consecutive_failures": 0,
    "rollout.prompts_per_batch": 0,
    "rollout.group_size": 0,
    "rollout.lease_seconds": ".inf",
    "rollout.poll_seconds": -1,
    "rollout.judge_fraction": 1.0,
    "eval.num_problems": 0,
    "eval.num_samples": 0,
    "eval.ks": "[0]",
    "eval.temperature": -1,
    "eval.bootstrap": 0,
    "eval.batch_size": 0,
    "eval.every": 0,
    "eval.orm_steps": -1,
    "eval.orm_batch_size": 0,
    "eval.orm_lr": 0,
    "eval.orm_holdout": 1.0,
    "mesh.trainer": "[0, 1, 1]",
    "mesh.sampler": "[1, 1, 1, 1, 1]",
    "sandbox.concurrency": -1,
    "environment.max_turns": 0,
    "environment.max_episode_tokens": 0,
    "environment.observation_chars": 4,  # no room for the truncation mark
    "environment.timeout_s": 0,
    "environment.memory_mb": 32,
    "environment.failed_call_penalty": -0.1,
    "paramserver.full_every": 0,
    "paramserver.tensor_parts": -1,
    "paramserver.pull_concurrency": 0,
    "paramserver.shard_mib": 0,
    "paramserver.range_mib": 0,
    "lora.rank": -1,
    "lora.alpha": 0,
    "lora.dropout": 1.0,
}


def test_paramserver_section_refuses_bad_dtypes_and_misaligned_parts():
    with pytest.raises(ConfigError, match="paramserver.dtype='float16'.*'sampler', 'float32'"):
        load_config(ROOT / "configs/tiny.yaml", ["paramserver.dtype=float16"])
    with pytest.raises(ConfigError, match="tensor_parts=4 .*line up with the sampler"):
        load_config(
            ROOT / "configs/tiny.yaml", ["mesh.sampler=[1, 1, 2]", "paramserver.tensor_parts=4"]
        )
    cfg = load_config(ROOT / "configs/tiny.yaml", ["mesh.sampler=[1, 1, 2]"])
    assert cfg.paramserver.parts(cfg.mesh.sampler) == 2
    assert cfg.paramserver.publish_dtype("bfloat16") == "bfloat16"  # "sampler": follows it
    assert cfg.paramserver.parts(None) == 1


@pytest.mark.parametrize("dotted", sorted(BAD_VALUES))
def test_each_numeric_field_refuses_a_value_outside_its_range(dotted):
    field = dotted.rsplit(".", 1)[-1]
    with pytest.raises(ConfigError, match=rf"{field}") as err:
        load_config(ROOT / "configs/tiny.yaml", [f"{dotted}={BAD_VALUES[dotted]}"])
    assert "allowed" in str(err.value)


def _numeric_fields(cls, prefix=""):
    import dataclasses
    import typing

    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_fields(tp, f"{prefix}{f.name}.")
            continue
        args = {a for a in typing.get_args(tp) if a is not type(None)} | {tp}
        flat = {x for a in args for x in (typing.get_args(a) or (a,))}
        if flat & {int, float} and bool not in flat:
            yield prefix + f.name


def test_every_numeric_field_has_a_bad_value_in_the_table():
    missing = sorted(set(_numeric_fields(RunConfig)) - set(BAD_VALUES))
    assert not missing, f"add a bad value for {missing} to BAD_VALUES (and a range check)"


def test_every_numeric_loss_hyper_parameter_has_a_bad_value_in_the_table():
    """The loss hyper-parameters live in pipeline.algorithms.LossSpec, set as trainer.X."""
    names = {f"trainer.{n}" for n, tp in PARAM_TYPES.items() if tp in (int, float)}
    missing = sorted(names - set(BAD_VALUES))
    assert not missing, f"add a bad value for {missing} to BAD_VALUES (and a range check)"


def test_infinities_and_nans_are_refused_in_any_float_field():
    for text in (".inf", "-.inf", ".nan", "inf"):
        with pytest.raises(ConfigError, match="allowed: a finite number"):
            load_config(ROOT / "configs/tiny.yaml", [f"trainer.lr={text}"])


def test_a_yaml_bool_is_not_an_integer(tmp_path):
    """`steps: true` was stored as 1."""
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  steps: true\n")
    with pytest.raises(ConfigError, match=r"trainer.steps=True is invalid; allowed: an integer"):
        load_config(path)


def test_init_refuses_prompts_that_leave_no_room_for_the_completion(tmp_path):
    """The cross-field rule that needs the data: longest prompt + max_new_tokens <=
    model.max_seq_len, checked after generation and before anything is written."""
    from pipeline.ops.cli import main
    from pipeline.tasks.mix import build_splits
    from pipeline.tokenizer import get_tokenizer

    url = str(tmp_path / "run")
    cfg = load_config(ROOT / "configs/tiny.yaml")
    tok = get_tokenizer(cfg.model.tokenizer)
    train, held_out = build_splits(cfg.task)
    longest = max(len(tok.encode_prompt(p.prompt)) for p in [*train, *held_out])
    room = cfg.model.max_seq_len - longest  # the most max_new_tokens may be
    args = ["init", "--run", url, "--config", "configs/tiny.yaml"]
    assert main([*args, f"sampler.max_new_tokens={room + 1}"]) == 2
    assert not (tmp_path / "run").exists()
    assert main([*args, f"sampler.max_new_tokens={room}"]) == 0


def test_init_writes_its_config_last_so_an_interrupted_one_is_retried_afresh(tmp_path):
    """An init interrupted while it generated the data left config.json (written first)
    and partial data; the corrected retry was then refused as "a different config". Now
    config.json is written last: an interruption leaves at most data without a config, as
    planted here (another config's held-out set), and the retry replaces it."""
    from pipeline.ops.cli import main
    from pipeline.problem_sets import write_data
    from pipeline.run import Run
    from pipeline.storage import open_store

    def ids(run: Run, split: str) -> list[str]:
        return [p.problem_id for p in run.read_problems(split)]

    url, fresh = str(tmp_path / "run"), str(tmp_path / "fresh")
    other = Run(url, open_store(url), load_config(ROOT / "configs/tiny.yaml", ["task.seed=5"]))
    write_data(other)  # what an init of another config, interrupted at its end, leaves
    assert not (tmp_path / "run" / "config.json").exists()
    left = {split: ids(other, split) for split in ("train", "eval")}
    for where in (url, fresh):
        assert main(["init", "--run", where, "--config", "configs/tiny.yaml"]) == 0
    run = Run.open(url)
    assert run.config.task.seed == 0
    for split in ("train", "eval"):
        assert ids(run, split) == ids(Run.open(fresh), split) != left[split]


def test_a_failed_init_leaves_nothing_behind(tmp_path):
    """task.max_digits=30 passed the config but failed while the data was generated,
    leaving config.json behind, so a retry with a fixed config was refused."""
    from pipeline.ops.cli import main

    url = str(tmp_path / "run")
    assert main(["init", "--run", url, "--config", "configs/tiny.yaml", "task.max_digits=30"])
    assert not (tmp_path / "run" / "config.json").exists()
    assert main(["init", "--run", url, "--config", "configs/tiny.yaml"]) == 0


# --------------------------------------------------------------------------------------
# Loss overrides, configs stored by earlier versions, the digest
# --------------------------------------------------------------------------------------

# config.json as `Run.create` wrote it before the loss overrides moved into `trainer.loss`:
# every LossSpec field and clip_eps at the top of `trainer`, null = the preset's value
# (configs/algorithms/grpo.yaml with trainer.steps=7 trainer.kl_coef=0.0).
OLD_CONFIG = ROOT / "tests/pipeline/data/config_before_loss_overrides.json"
OLD_DIGEST = "668c60638c3de32b"  # what that version wrote into the run's checkpoints


def test_a_config_stored_before_the_loss_overrides_still_loads():
    text = OLD_CONFIG.read_text()
    old = json.loads(text)
    assert old["trainer"]["kl_coef"] == 0.0 and old["trainer"]["gamma"] is None
    assert "loss" not in old["trainer"]
    cfg = config_from_json(text)
    today = load_config(
        ROOT / "configs/algorithms/grpo.yaml", ["trainer.steps=7", "trainer.kl_coef=0.0"]
    )
    assert cfg == today and cfg.digest() == today.digest()
    # Set values moved into the overrides, nulls dropped, clip_eps expanded.
    assert cfg.trainer.loss == {
        "advantage": "grpo",
        "policy_loss": "ppo_clip",
        "aggregation": "seq_mean_token_mean",
        "eps_low": 0.2,
        "eps_high": 0.2,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "is_correction": "tis",
        "is_cap": 2.0,
    }
    assert migrate(migrate(old)) == migrate(old)  # idempotent
    assert legacy_digest(old) == OLD_DIGEST


def test_a_run_created_before_the_loss_overrides_accepts_its_checkpoints(tmp_path):
    """The trainer resumes when a checkpoint's digest is one of `Run.config_digests()`."""
    from pipeline.run import CONFIG_KEY, Run
    from pipeline.storage import open_store

    url = str(tmp_path / "run")
    open_store(url).write_new(CONFIG_KEY, OLD_CONFIG.read_bytes())
    run = Run.open(url)
    assert OLD_DIGEST in run.config_digests()
    assert run.config.digest() in run.config_digests()
    again = Run.create(url, run.config)  # a retry of the same config reopens it
    assert again.config == run.config


def test_the_digest_ignores_a_field_added_later_with_its_default():
    """Adding a defaulted field to a section changes no existing config's digest (before,
    the digest hashed every field, and old runs refused to resume)."""
    cfg = config_from_json(OLD_CONFIG.read_text())
    Grown = dataclasses.make_dataclass(
        "TrainerConfig",
        [("new_knob", float, dataclasses.field(default=0.5))],
        bases=(TrainerConfig,),
        frozen=True,
    )
    grown_trainer = Grown(**{f.name: getattr(cfg.trainer, f.name) for f in fields(cfg.trainer)})
    grown = dataclasses.replace(cfg, trainer=grown_trainer)
    assert grown.digest() == cfg.digest()
    assert legacy_digest(grown.to_dict()) != legacy_digest(cfg.to_dict())  # the old way
    # A value that differs from the default does count.
    assert dataclasses.replace(grown, trainer=grown_trainer.replace(new_knob=1.0)).digest() != (
        cfg.digest()
    )


def test_loss_overrides_two_spellings_and_layers(tmp_path):
    flat = load_config(None, ["trainer.kl_coef=0.01"])
    nested = load_config(None, ["trainer.loss.kl_coef=0.01"])
    assert flat == nested and flat.trainer.loss == {"kl_coef": 0.01}
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  kl_coef: 0.0\n  clip_eps: 0.1\n")
    cfg = load_config(path, ["trainer.loss.kl_coef=0.02", "trainer.eps_high=0.3"])
    assert cfg.trainer.loss == {"kl_coef": 0.02, "eps_low": 0.1, "eps_high": 0.3}
    assert load_config(path, ["trainer.kl_coef=null"]).trainer.loss == {
        "eps_low": 0.1,
        "eps_high": 0.1,
    }  # null: back to the preset's value
    with pytest.raises(ConfigError, match="disagree"):
        load_config(None, ["trainer.kl_coef=0.1", "trainer.loss.kl_coef=0.2"])
    with pytest.raises(ConfigError, match="unknown loss hyper-parameter 'trainer.clip'"):
        load_config(None, ["trainer.loss.clip=0.1"])
    assert TrainerConfig().replace(kl_coef=0, steps=3).loss == {"kl_coef": 0.0}


def test_family_options_live_in_their_own_sections_and_old_spellings_still_load():
    new = load_config(
        "configs/tiny.yaml", ["task.arithmetic.max_digits=3", "task.arithmetic.carry_drop_prob=0.2"]
    )
    old = load_config("configs/tiny.yaml", ["task.max_digits=3", "sft.carry_drop_prob=0.2"])
    assert old == new and old.task.arithmetic.max_digits == 3
    assert new.task.options_for("arithmetic").carry_drop_prob == 0.2
    # Digested where the keys used to live, so runs created before the move still resume:
    # the hash of {"task": {"max_digits": 3}, ...} as the earlier `digest` computed it.
    settings = {"sft": {"carry_drop_prob": 0.2}, "task": {"max_digits": 3}}
    tiny = load_config("configs/tiny.yaml")
    import hashlib

    from pipeline.config_io import non_defaults

    base = non_defaults(tiny)
    arith = base["task"].pop("arithmetic")
    base["task"].update(arith)  # tiny.yaml's own digit range, in the old places
    base["task"]["max_digits"] = 3
    base.setdefault("sft", {}).update(settings["sft"])
    blob = json.dumps(base, sort_keys=True, default=list).encode()
    assert new.digest() == hashlib.sha256(blob).hexdigest()[:16]
    with pytest.raises(ConfigError, match="task.max_digits=3 .* disagree"):
        load_config(None, extra={"task": {"max_digits": 3, "arithmetic": {"max_digits": 4}}})


def test_dataset_families_have_no_generator_and_say_where_problems_come_from(monkeypatch):
    # Every built-in family generates problems now (code also scores curated ones), so a
    # real dataset-only family, a verifier and nothing else, is registered for the test.
    from pipeline.tasks import TASKS
    from pipeline.tasks import config as task_config
    from pipeline.tasks.base import Task, final_answer
    from pipeline.tasks.mix import synthetic_task

    class LookupTask(Task):
        name = "lookup"

        def extract_answer(self, completion):
            return final_answer(completion, 16)

        def verify(self, problem, completion):
            return float(self.extract_answer(completion) == problem.answer)

    monkeypatch.setitem(TASKS, "lookup", LookupTask())
    assert synthetic_task("arithmetic").name == "arithmetic"
    assert synthetic_task("code").name == "code"
    with pytest.raises(
        ValueError, match="'lookup' has a verifier but no problem generator.*source_data"
    ):
        synthetic_task("lookup")
    fields = {f.name for f in dataclasses.fields(task_config._task_config_class())}
    assert {"arithmetic", "countdown", "code"} <= fields and "lookup" not in fields


def test_sandbox_section_defaults_leave_the_digest_and_the_backend_alone(monkeypatch):
    """`sandbox` came after runs existed: its defaults change no digest, and `apply` with no
    url keeps the process's backend (the local pool, or RLAX_SANDBOX_URL)."""
    import pipeline.sandbox as sandbox
    from pipeline.sandbox.client import RemoteSandbox

    cfg = config_from_json(OLD_CONFIG.read_text())
    assert cfg.sandbox == load_config(None).sandbox and cfg.sandbox.url == ""
    assert dataclasses.replace(cfg, sandbox=type(cfg.sandbox)()).digest() == cfg.digest()
    monkeypatch.setattr(sandbox, "_backend", None)
    cfg.sandbox.apply()
    assert sandbox._backend is None  # untouched: chosen from the environment on first use

    monkeypatch.setenv("MY_SANDBOX_TOKEN", "t0k")
    remote = load_config(
        None, ["sandbox.url=http://127.0.0.1:8123", "sandbox.token_env=MY_SANDBOX_TOKEN"]
    )
    assert remote.digest() != cfg.digest()
    remote.sandbox.apply()
    backend = sandbox.backend()
    assert isinstance(backend, RemoteSandbox) and backend.url == "http://127.0.0.1:8123"
    assert backend._http.headers["authorization"] == "Bearer t0k"
    sandbox.configure(None)  # back to the local pool


def test_environment_section_names_the_known_environments_and_fits_the_model():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["environment.name=python"])
    assert cfg.environment.multi_turn
    assert cfg.completion_tokens() == cfg.environment.max_episode_tokens
    assert load_config(ROOT / "configs/tiny.yaml").completion_tokens() == (
        load_config(ROOT / "configs/tiny.yaml").sampler.max_new_tokens
    )
    with pytest.raises(ConfigError, match=r"environment.name='calc' .* 'none', 'python'"):
        load_config(ROOT / "configs/tiny.yaml", ["environment.name=calc"])
    with pytest.raises(ConfigError, match=r"max_episode_tokens=.*< model.max_seq_len"):
        load_config(
            ROOT / "configs/tiny.yaml",
            ["environment.name=python", "environment.max_episode_tokens=100000"],
        )


# (digest, sha256 of the config.json a run stores) of every shipped config, computed on
# main before the sections moved to their owners (issue 36): moving a section must change
# neither, or runs created before the move would no longer resume. A section added since
# or a field added to a section since (NEW_KEYS) is left out of the stored bytes' hash
# where it holds its default: it adds a key to config.json, and its defaults keep the
# digest unchanged (and a config.json without it loads to the same config). A shipped
# config that sets one (demo_code.yaml: task.code.slip) keeps it in the hash.
NEW_KEYS = (
    "lora",
    "distill",
    "trainer.judge_loss_weight",
    "task.code.slip",
    "trainer.routing_replay",
    "rollout.inflight_batches",
    "sampler.vllm_weight_transfer",
    "eval.self_conf",
    *(
        f"model.{name}"
        for name in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "shared_expert_intermediate_size",
            "router_aux_loss_coef",
            "router_z_loss_coef",
            "moe_dispatch",
        )
    ),
)
SHIPPED_DIGESTS = {
    "configs/algorithms/cispo.yaml": ("79dcd5288ef7fd18", "2557a42d8bac1f96"),
    "configs/algorithms/dapo.yaml": ("b549b53164c76c67", "7f48b349ccee7493"),
    "configs/algorithms/drgrpo.yaml": ("bba75a283acbd0c8", "e46bab75ee202527"),
    "configs/algorithms/grpo.yaml": ("20c1d7a5defaf5fe", "4e2edbf8c1554bc4"),
    "configs/algorithms/gspo.yaml": ("4c0c1e89b2ea0a74", "3a42cabdfe8b4016"),
    "configs/algorithms/ppo.yaml": ("02577b83a39c8b83", "eeb8bbb4788201cb"),
    "configs/algorithms/reinforce.yaml": ("0c4c3ca101fff45e", "fd6b4327b91673a4"),
    "configs/algorithms/reinforce_pp.yaml": ("d93680710835b163", "96642fa289dfcdc1"),
    "configs/algorithms/reinforce_pp_baseline.yaml": ("71f282180c5cf9d6", "d85ff32a7f3b8e88"),
    "configs/algorithms/rloo.yaml": ("2c4db5e7112e04d4", "85f642ff02305f12"),
    "configs/chaos.yaml": ("06579748d7f19b72", "e6c946145d419ceb"),
    "configs/demo.yaml": ("d403800a7351eae7", "4e254106a1ffb2fb"),
    "configs/demo_code.yaml": ("fec55c3b434bc21f", "b80172fbc15c19b1"),  # issue 43: new recipe
    "configs/demo_judge.yaml": ("f9f2b79807a28200", "06e2ec594c374b27"),
    "configs/demo_tools.yaml": ("fc7141845d032647", "c5f02643a86003bf"),
    "configs/tiny.yaml": ("142d0736cbdd3f28", "51246ed03630a5d7"),
}


@pytest.mark.parametrize("path", sorted(SHIPPED_DIGESTS))
def test_shipped_configs_keep_their_digest_and_stored_config_json(path):
    import hashlib

    cfg = load_config(ROOT / path)
    tree = cfg.to_dict()
    stored = json.dumps(tree, indent=2, sort_keys=True).encode()  # as Run.create
    pinned = json.loads(json.dumps(tree))
    defaults = json.loads(json.dumps(load_config(None).to_dict()))
    for key in NEW_KEYS:
        *parents, leaf = key.split(".")
        section, default = pinned, defaults
        for part in parents:
            section, default = section[part], default[part]
        if section[leaf] == default[leaf]:
            del section[leaf]
    pinned_bytes = json.dumps(pinned, indent=2, sort_keys=True).encode()
    assert (cfg.digest(), hashlib.sha256(pinned_bytes).hexdigest()[:16]) == SHIPPED_DIGESTS[path]
    assert config_from_json(stored.decode()) == cfg
    assert config_from_json(pinned_bytes.decode()) == cfg  # a config.json from before


def _project_imports(path: Path) -> set[str]:
    """The pipeline modules a file imports anywhere, `if TYPE_CHECKING:` included."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline"):
            for alias in node.names:  # `from pipeline import sandbox` imports a module
                name = f"{node.module}.{alias.name}"
                is_module = (ROOT / (name.replace(".", "/") + ".py")).exists()
                out.add(name if is_module else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("pipeline"))
    return out


def test_self_confidence_names_are_the_metrics_registry():
    from pipeline.config import SELF_CONFIDENCE
    from pipeline.metrics import CONFIDENCE

    assert tuple(CONFIDENCE) == SELF_CONFIDENCE


def test_each_section_lives_with_its_owner_and_none_reaches_back_to_the_run_config():
    # The run config composes the owners' sections; it imports no registry to check a
    # name (each section checks its own), and no owner's section module imports the run
    # config or the run handle back (the import loop of issue 36).
    sections = {
        "pipeline.environments.config": "EnvironmentConfig",
        "pipeline.sandbox.config": "SandboxConfig",
        "pipeline.paramserver.config": "ParamServerConfig",
        "pipeline.storage.config": "StorageConfig",
        "pipeline.tasks.config": "TaskConfig",
        "pipeline.tracking": "TrackingConfig",
        "pipeline.mesh": "MeshConfig",
        "pipeline.lora": "LoraConfig",
        "pipeline.distill": "DistillConfig",
    }
    hints = {f.name: f.type for f in fields(RunConfig)}
    assert set(sections.values()) <= set(hints.values())
    imported = _project_imports(ROOT / "pipeline/config.py")
    central = {"pipeline.algorithms", "pipeline.config_io", "pipeline.errors", "pipeline.tokenizer"}
    assert imported == central | set(sections)
    for module in [*sections, "pipeline.config_io", "pipeline.tb_export"]:
        path = ROOT / (module.replace(".", "/") + ".py")
        assert not _project_imports(path) & {"pipeline.config", "pipeline.run"}, module


def test_mixture_of_experts_fields():
    """The MoE presets fill the expert fields; a dense model refuses them; top-k is at most
    the experts; LoRA on a MoE model targets the attention projections only."""
    moe, demo = ModelConfig(preset="demo_moe"), ModelConfig(preset="demo")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 192)
    assert moe.moe and not demo.moe and demo.num_experts == 0
    # top-2 of the experts' sizes is the dense demo's MLP: the same active size.
    assert moe.num_experts_per_tok * moe.moe_intermediate_size == demo.intermediate_size
    assert load_config(ROOT / "configs/tiny.yaml", ["model.preset=demo_moe"]).model.moe
    with pytest.raises(ConfigError, match=r"model.num_experts_per_tok=9 is invalid; allowed: 1..n"):
        load_config(
            ROOT / "configs/tiny.yaml", ["model.preset=demo_moe", "model.num_experts_per_tok=9"]
        )
    with pytest.raises(
        ConfigError, match="model.moe_intermediate_size=8 is invalid; allowed: 0 on a"
    ):
        load_config(ROOT / "configs/tiny.yaml", ["model.moe_intermediate_size=8"])
    with pytest.raises(
        ConfigError, match=r"lora.targets=.*allowed: attention projections only \(q, k, v, o\)"
    ):
        load_config(ROOT / "configs/tiny.yaml", ["model.preset=tiny_moe", "lora.rank=4"])
