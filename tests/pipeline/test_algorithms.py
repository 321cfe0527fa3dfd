"""The loss specification (pipeline/algorithms.py): light, one check per hyper-parameter,
and the needs the trainer asks instead of comparing names."""

import dataclasses
import subprocess
import sys

import pytest

from pipeline import algorithms as A
from pipeline.config import ConfigError


def test_the_config_imports_no_jax():
    code = "import sys, pipeline.config; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_every_hyper_parameter_has_its_check():
    for f in dataclasses.fields(A.LossSpec):
        assert {"allowed", "ok"} <= set(f.metadata), f.name
        assert f.metadata["ok"](f.default), f.name  # the default passes its own check


@pytest.mark.parametrize("alg", sorted(A.PRESETS))
def test_the_spec_says_what_each_preset_needs(alg):
    spec = A.PRESETS[alg]
    assert spec.needs_value_head == (alg == "ppo")  # GAE's critic, trained with vf_coef
    assert spec.needs_reference == (spec.kl_coef > 0 or spec.reward_kl_coef > 0)
    assert spec.denominator == ("tokens" if spec.aggregation == "token_mean" else "sequences")


def test_shorthand_and_unknown_names():
    assert A.expand({"clip_eps": 0.1, "eps_high": 0.3}) == {"eps_low": 0.1, "eps_high": 0.3}
    with pytest.raises(ConfigError, match="trainer.clip_eps=1.5 is invalid"):
        A.check_param("clip_eps", 1.5, "trainer.")
    with pytest.raises(ConfigError, match="unknown loss hyper-parameter 'loss.clip'"):
        A.check_param("clip", 0.1, "loss.")
    with pytest.raises(ConfigError, match="loss.global_baseline=1 is invalid"):
        A.LossSpec(global_baseline=1)
