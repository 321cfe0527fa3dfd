import json
from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, config_from_json, load_config, parse_overrides

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
        ("model.num_kv_heads=3", ["model.num_kv_heads", "divisor"]),
        ("eval.ks=[1,16]", ["eval.ks", "num_samples=8"]),
        ("mesh.trainer=[2,2]", ["mesh.trainer", "3 sizes", "'tensor'"]),
        ("mesh.sampler=[-1,-1,1]", ["mesh.sampler", "at most one"]),
        ("mesh.trainer=[0,1,1]", ["mesh.trainer", ">= 1 or -1"]),
        ("model.tokenizer=bpe", ["model.tokenizer", "'char'", "'hf'"]),
        ("nonsense", ["section.field=value"]),
    ],
)
def test_invalid_values_name_field_and_allowed(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/demo.yaml", [override])
    for w in words:
        assert w in str(err.value)


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
