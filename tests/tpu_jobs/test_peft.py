"""LoRA adapters in PEFT's format against `peft` itself (tpu_jobs/model/peft_adapter.py,
`python -m tpu_jobs.hf import --adapter / export`): names and shapes as PEFT writes them,
logits of transformers + peft against the project's, bit-exact round trips, refusals.

The models are test_hf's tiny random Qwen2 (q/k/v biases, tied embeddings) and Qwen3
(q/k norms, head_dim != hidden / heads), float32; the adapters random and non-zero (B too,
unlike a fresh adapter), so a wrong transpose, name or scale moves the logits by far more
than the bound: 1e-4, the bound test_hf holds the bare models to.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

pytestmark = pytest.mark.lora  # the `lora` lane of .ci/run (make test stays < 12 min)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from pipeline.lora import LoraConfig, adapter_shapes, merge  # noqa: E402
from tests.tpu_jobs.test_hf import MASK, TOKENS, build_hf, hf_logits, our_logits  # noqa: E402
from tpu_jobs import hf  # noqa: E402
from tpu_jobs.model import hf_checkpoint, peft_adapter  # noqa: E402
from tpu_jobs.model.transformer import init_model, load_flat_params  # noqa: E402

TOL = 1e-4
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


def random_adapters(base: dict[str, np.ndarray], lora: LoraConfig, seed: int = 0):
    """Non-zero A and B, sized so the update changes the logits by O(0.1)."""
    rng = np.random.default_rng(seed)
    return {
        n: (0.2 * rng.standard_normal(s)).astype(np.float32)
        for n, s in adapter_shapes({k: v.shape for k, v in base.items()}, lora).items()
    }


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{family: (transformers model, checkpoint dir, ModelConfig, flat base)}."""
    out = {}
    for family in ("qwen2", "qwen3"):
        model = build_hf(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        cfg, flat = hf_checkpoint.load_hf_checkpoint(path)
        out[family] = (model, path, cfg, flat)
    return out


def peft_logits(hf_model, adapter_dir) -> np.ndarray:
    wrapped = peft.PeftModel.from_pretrained(hf_model, adapter_dir).eval()
    try:
        return hf_logits(wrapped, TOKENS, MASK)
    finally:
        wrapped.unload()  # the module fixture's model without LoRA layers again


def test_names_and_shapes_are_peft_own(bases, tmp_path):
    """What peft.get_peft_model(...).save_pretrained writes for our adapter_config.json:
    the same tensor names and shapes, read back by load_peft as our flat adapters."""
    _, _, cfg, flat = bases["qwen3"]
    lora = LoraConfig(rank=3, alpha=6.0, targets=("q", "down"))
    ours = peft_adapter.peft_config(lora)
    config = peft.LoraConfig(**{k: v for k, v in ours.items() if k != "peft_type"})
    wrapped = peft.get_peft_model(build_hf("qwen3"), config)
    with torch.no_grad():  # non-zero B, so the read-back values say something
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_()
    wrapped.save_pretrained(tmp_path / "theirs")
    theirs = hf_checkpoint.read_safetensors(tmp_path / "theirs" / peft_adapter.ADAPTER_WEIGHTS_FILE)
    expected = adapter_shapes({k: v.shape for k, v in flat.items()}, lora)
    written = peft_adapter.adapters_to_peft(random_adapters(flat, lora))
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in theirs.items()}
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in written
    assert len(written) == len(expected) == 2 * 2 * cfg.num_layers
    back = peft_adapter.load_peft(tmp_path / "theirs", lora, {k: v.shape for k, v in flat.items()})
    module = wrapped.base_model.model.model.layers[1].self_attn.q_proj
    np.testing.assert_array_equal(
        back["layers.1.self_attn.q_proj.lora_b"], module.lora_B["default"].weight.detach().T
    )
    # PEFT's own adapter, re-exported by us, is the same tensors bit for bit.
    peft_adapter.export_peft(tmp_path / "again", lora, back)
    again = hf_checkpoint.read_safetensors(tmp_path / "again" / peft_adapter.ADAPTER_WEIGHTS_FILE)
    assert again.keys() == theirs.keys()
    assert all(np.array_equal(again[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_peft_applies_the_exported_adapter_as_we_do(bases, family, tmp_path):
    hf_model, _, cfg, flat = bases[family]
    adapters = random_adapters(flat, LORA)
    adapter_dir = peft_adapter.export_peft(tmp_path / "adapter", LORA, adapters)
    ref = peft_logits(hf_model, adapter_dir)
    # The samplers' path: the base's flat tensors merged (pipeline.lora.merge), loaded.
    model = init_model(cfg, 0)
    load_flat_params(model, merge(flat, adapters, LORA.scale))
    real = MASK.astype(bool)
    assert np.abs(our_logits(model, TOKENS, MASK) - ref)[real].max() <= TOL
    # The trainer's path: the base and the adapters unmerged, in the model's LoRA `Linear`.
    unmerged = init_model(cfg, 0, LORA)
    load_flat_params(unmerged, {**flat, **adapters})
    assert np.abs(our_logits(unmerged, TOKENS, MASK) - ref)[real].max() <= TOL
    # The adapter matters far beyond the bound, so a wrong layout cannot pass.
    assert np.abs(hf_logits(hf_model, TOKENS, MASK) - ref)[real].max() > 100 * TOL


def test_round_trip_is_bit_exact(bases, tmp_path):
    _, _, _, flat = bases["qwen2"]
    shapes = {k: v.shape for k, v in flat.items()}
    adapters = random_adapters(flat, LORA, seed=3)
    peft_adapter.export_peft(tmp_path / "a", LORA, adapters)
    back = peft_adapter.load_peft(tmp_path / "a", LORA, shapes)
    assert back.keys() == adapters.keys()
    assert all(np.array_equal(back[k], adapters[k]) and back[k].dtype == np.float32 for k in back)
    config = json.loads((tmp_path / "a" / peft_adapter.ADAPTER_CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8, "CAUSAL_LM")
    assert peft.LoraConfig.from_pretrained(tmp_path / "a").target_modules == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def _edit_config(directory, **changes) -> None:
    path = directory / peft_adapter.ADAPTER_CONFIG_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_mismatched_adapters_are_refused(bases, tmp_path):
    _, _, _, flat = bases["qwen3"]
    shapes = {k: v.shape for k, v in flat.items()}
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "v"))
    good = peft_adapter.export_peft(tmp_path / "good", lora, random_adapters(flat, lora))
    with pytest.raises(hf.HFError, match=r"lora.rank=2 \(adapter: 4\).*lora.rank=4 lora.alpha=8"):
        peft_adapter.load_peft(good, LoraConfig(rank=2, alpha=8.0, targets=("q", "v")), shapes)
    with pytest.raises(hf.HFError, match=r"lora.alpha=16.0 \(adapter: 8\)"):
        peft_adapter.load_peft(good, LoraConfig(rank=4, targets=("q", "v")), shapes)
    with pytest.raises(hf.HFError, match=r"lora.targets=\['k', 'q'\] \(adapter: \['q', 'v'\]\)"):
        peft_adapter.load_peft(good, LoraConfig(rank=4, alpha=8.0, targets=("q", "k")), shapes)
    with pytest.raises(hf.HFError, match="lora.rank=0 but a PEFT adapter was given"):
        peft_adapter.load_peft(good, LoraConfig(), shapes)
    # Another base: an intermediate size of 48, not 64 (gate/up/down do not fit).
    up = replace(lora, targets=("up",))
    small = {k: (v[:, :48] if "up_proj" in k else v) for k, v in flat.items()}
    bad = peft_adapter.export_peft(tmp_path / "other_base", up, random_adapters(small, up))
    with pytest.raises(hf.HFError, match=r"does not fit the base: mis-shaped .*up_proj.lora_B"):
        peft_adapter.load_peft(bad, up, shapes)
    for field, value, allowed in [
        ("use_dora", True, "False"),
        ("use_rslora", True, "False"),
        ("peft_type", "IA3", "'LORA'"),
        ("target_modules", "all-linear", "a list of q_proj"),
        ("target_modules", ["q_proj", "lm_head"], "a list of q_proj"),
    ]:
        _edit_config(good, **{field: value})
        with pytest.raises(hf.HFError, match=f"{field}=.*; allowed: {allowed}"):
            peft_adapter.load_peft(good, lora, shapes)
        _edit_config(good, **peft_adapter.peft_config(lora))
    (good / peft_adapter.ADAPTER_WEIGHTS_FILE).unlink()
    with pytest.raises(hf.HFError, match="adapter_model.safetensors not found"):
        peft_adapter.load_peft(good, lora, shapes)


def test_cli_import_adapter_then_export_both_forms(bases, tmp_path):
    from pipeline.paramserver import ParamServer
    from pipeline.run import Run, base_server, start_adapter_server

    hf_model, path, cfg, flat = bases["qwen2"]
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down"))
    start = random_adapters(flat, lora, seed=5)
    adapter_dir = peft_adapter.export_peft(tmp_path / "start", lora, start)
    small = ["task.num_train=16", "task.num_eval=4"]
    lora_set = ["lora.rank=4", "lora.alpha=8", "lora.targets=[q,v,down]"]
    run_url = str(tmp_path / "run")
    # Refused before anything is created when the run's lora section disagrees.
    with pytest.raises(hf.HFError, match=r"lora.rank=8 \(adapter: 4\)"):
        hf.import_to_run(path, run_url, overrides=[*small, "lora.rank=8"], adapter=adapter_dir)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    # The command `rlax import-hf PATH --adapter DIR --run URL` starts (pipeline.ops).
    from pipeline.ops.launcher import HF_MODULE, hf_import_command

    cmd = hf_import_command(str(path), run_url, str(adapter_dir))
    assert cmd[1:3] == ["-m", HF_MODULE]
    args = cmd[3:]
    assert hf.main([*args, *small, *lora_set]) == 0
    run = Run.open(run_url)
    assert run.config.lora == lora
    got = start_adapter_server(run).pull(0).tensors
    assert got.keys() == start.keys() and all(np.array_equal(got[k], start[k]) for k in start)
    assert set(base_server(run).pull(0).tensors) == set(flat)  # the base stays bare
    assert hf.main(args) == 0  # idempotent

    # An adapter-only version (the adapters alone; the base from base/ v0).
    trained = random_adapters(flat, lora, seed=6)
    ps = ParamServer(run.store)
    ps.publish(2, trained, epoch=ps.acquire_epoch())
    out = tmp_path / "export"
    assert hf.main(["export", "--run", run_url, "--version", "2", "--out", str(out)]) == 0
    ref = peft_logits(hf_model, out / hf.ADAPTER_DIR)
    config = json.loads((out / hf.ADAPTER_DIR / peft_adapter.ADAPTER_CONFIG_FILE).read_text())
    assert config["base_model_name_or_path"] == str(path.resolve())
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert np.abs(hf_logits(merged, TOKENS, MASK) - ref)[MASK.astype(bool)].max() <= TOL
    back = peft_adapter.load_peft(out / hf.ADAPTER_DIR, lora, {k: v.shape for k, v in flat.items()})
    assert all(np.array_equal(back[k], trained[k]) for k in trained)

    only = tmp_path / "only"
    assert hf.main(["export", "--run", run_url, "--out", str(only), "--adapter-only"]) == 0
    assert sorted(p.name for p in only.iterdir()) == [hf.ADAPTER_DIR]
    base_only = ["export", "--run", run_url, "--base", "--out", str(tmp_path / "b")]
    assert hf.main([*base_only, "--adapter-only"]) == 2  # the base has no adapters
