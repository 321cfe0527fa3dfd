"""HF import/export against `transformers` itself: tiny random Llama/Qwen2/Qwen3 models built
offline in float32, logits and greedy generations compared, export reloaded by
`from_pretrained`, sharded checkpoints, the tokenizer adapter and the run CLI."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.config import ModelConfig  # noqa: E402
from pipeline.tokenizer import get_tokenizer  # noqa: E402
from pipeline.tokenizer import hf as hf_tokenizer  # noqa: E402
from pipeline.tokenizer.run import load_run_tokenizer, run_tokenizer  # noqa: E402
from tpu_jobs import hf  # noqa: E402
from tpu_jobs.generate.decode_layouts import DECODE_LAYOUTS  # noqa: E402
from tpu_jobs.generate.interface import SamplingParams  # noqa: E402
from tpu_jobs.generate.static_sampler import StaticSampler  # noqa: E402
from tpu_jobs.model import hf_checkpoint  # noqa: E402
from tpu_jobs.model.transformer import flat_params, positions_from_mask  # noqa: E402

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
torch.set_num_threads(1)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.15,  # large enough that greedy argmaxes are never near-ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = {
    # rope_theta != default and untied embeddings on Llama; tied ones on Qwen2;
    # head_dim != hidden / heads on Qwen3 (as in the real Qwen3 models).
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_theta=5000.0, tie_word_embeddings=False),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
}
TOKENS = np.random.default_rng(0).integers(3, VOCAB, (3, 11))
MASK = np.ones_like(TOKENS)
MASK[1, :4] = 0  # left padding
MASK[2, :7] = 0


def build_hf(family: str | tuple[str, str, dict], seed: int = 0, **config_overrides):
    """A tiny random HF model of `family` (a key of FAMILIES, or such a triple)."""
    cfg_cls, model_cls, extra = FAMILIES[family] if isinstance(family, str) else family
    extra = dict(extra)
    theta = extra.pop("rope_theta", None)
    if theta is not None:
        extra["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    kwargs = {**COMMON, **extra, **config_overrides}
    config = getattr(transformers, cfg_cls)(**kwargs, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # non-trivial norm weights and biases (zeros / ones at init)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("gate.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    out = {}
    for family in FAMILIES:
        model = build_hf(family)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = (model, path)
    return out


def hf_logits(model, tokens, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


@nnx.jit
def _forward(model, tokens, mask):
    return model(tokens, positions_from_mask(mask), mask)[0]


def our_logits(model, tokens, mask) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(mask)))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(checkpoints, family):
    hf_model, path = checkpoints[family]
    model, cfg = hf_checkpoint.load_hf_model(path)
    hcfg = hf_model.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (32, 2, 4, 2)
    assert cfg.head_dim == hcfg.head_dim if family == "qwen3" else cfg.head_dim == 8
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.tie_embeddings == hcfg.tie_word_embeddings
    assert cfg.rope_theta == (5000.0 if family == "llama" else 10000.0)
    assert cfg.rms_norm_eps == 1e-5 and cfg.vocab_size == VOCAB
    ref, ours = hf_logits(hf_model, TOKENS, MASK), our_logits(model, TOKENS, MASK)
    real = MASK.astype(bool)  # padded query rows are garbage in both
    assert np.abs(ours - ref)[real].max() <= 1e-4
    assert np.abs(ref).max() > 0.5  # not a degenerate model


@pytest.mark.parametrize("layout", sorted(DECODE_LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(checkpoints, family, layout):
    hf_model, path = checkpoints[family]
    model, cfg = hf_checkpoint.load_hf_model(path)
    prompts = [[1, 5, 9, 17], [1, 40, 41, 42, 43, 44, 45, 46], [1, 7]]
    width = max(map(len, prompts))
    ids = np.array([[0] * (width - len(p)) + p for p in prompts])
    mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    hf_model.generation_config.eos_token_id = None  # run all 32 steps in both
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )[:, width:].numpy()
    sampler = StaticSampler(cfg, pad_id=0, eos_id=-1, decode_layout=layout)
    keys = jax.random.split(jax.random.key(0), len(prompts))
    out = sampler.generate(model, prompts, keys, SamplingParams(max_new_tokens=32, temperature=0.0))
    assert ref.shape == (3, 32)
    np.testing.assert_array_equal(out.tokens, ref)
    assert len(set(ref.reshape(-1).tolist())) > 4  # not a constant sequence


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_reloads_in_transformers(checkpoints, family, tmp_path):
    _, path = checkpoints[family]
    model, cfg = hf_checkpoint.load_hf_model(path)
    flat = flat_params(model)
    rng = np.random.default_rng(1)  # change every weight so nothing is read from `path`
    flat = {
        k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in flat.items()
    }
    hf_checkpoint.export_hf(tmp_path / "out", cfg, flat)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert type(reloaded).__name__ == FAMILIES[family][1]
    assert reloaded.dtype == torch.float32
    from tpu_jobs.model.transformer import load_flat_params

    load_flat_params(model, flat)
    ref = hf_logits(reloaded, TOKENS, MASK)
    assert np.abs(our_logits(model, TOKENS, MASK) - ref)[MASK.astype(bool)].max() <= 1e-4
    cfg2, flat2 = hf_checkpoint.load_hf_checkpoint(tmp_path / "out")  # and back: bit-identical
    assert cfg2 == cfg
    assert all(np.array_equal(flat[k], flat2[k]) for k in flat) and flat.keys() == flat2.keys()


def test_untied_export_is_the_same_function(checkpoints, tmp_path):
    """hf_checkpoint.untie_embeddings (the vLLM sampler's export): an LM head of its own, equal to
    the embedding, gives transformers the tied model's logits."""
    _, path = checkpoints["qwen2"]  # tied
    model, cfg = hf_checkpoint.load_hf_model(path)
    ucfg, uflat = hf_checkpoint.untie_embeddings(cfg, flat_params(model))
    assert cfg.tie_embeddings and not ucfg.tie_embeddings
    assert np.array_equal(uflat["lm_head.kernel"], uflat["embed_tokens.embedding"].T)
    hf_checkpoint.export_hf(tmp_path / "untied", ucfg, uflat)
    assert not json.loads((tmp_path / "untied/config.json").read_text())["tie_word_embeddings"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "untied", attn_implementation="eager"
    ).eval()
    ref = hf_logits(reloaded, TOKENS, MASK)
    assert np.abs(our_logits(model, TOKENS, MASK) - ref)[MASK.astype(bool)].max() <= 1e-4
    assert hf_checkpoint.untie_embeddings(ucfg, uflat)[0] is ucfg  # untied already: unchanged


def test_sharded_checkpoints_and_bfloat16(checkpoints, tmp_path):
    hf_model, path = checkpoints["llama"]
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / hf_checkpoint.INDEX_FILE).is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    cfg, whole = hf_checkpoint.load_hf_checkpoint(path)
    _, sharded = hf_checkpoint.load_hf_checkpoint(tmp_path / "sharded")
    assert (
        all(np.array_equal(whole[k], sharded[k]) for k in whole) and whole.keys() == sharded.keys()
    )
    # Our own sharded export loads in transformers; bfloat16 export rounds like torch does.
    hf_checkpoint.export_hf(tmp_path / "ours", cfg, whole, max_shard_bytes=30_000)
    assert (
        len(json.loads((tmp_path / "ours" / hf_checkpoint.INDEX_FILE).read_text())["weight_map"])
        == 21
    )
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    )
    np.testing.assert_array_equal(
        hf_logits(reloaded, TOKENS, MASK), hf_logits(hf_model, TOKENS, MASK)
    )
    hf_checkpoint.export_hf(tmp_path / "bf16", cfg, whole, dtype="bfloat16")
    bf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    w = hf_model.model.layers[0].mlp.up_proj.weight.detach()
    assert torch.equal(bf.model.layers[0].mlp.up_proj.weight, w.to(torch.bfloat16))
    _, back = hf_checkpoint.load_hf_checkpoint(tmp_path / "bf16")
    name = "layers.0.mlp.up_proj.kernel"
    np.testing.assert_array_equal(back[name], w.to(torch.bfloat16).float().numpy().T)


def test_unsupported_and_mismatched_checkpoints(checkpoints, tmp_path):
    base = json.loads((checkpoints["llama"][1] / "config.json").read_text())
    with pytest.raises(hf.HFError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        hf_checkpoint.model_config_from_hf({**base, "architectures": ["GPT2LMHeadModel"]})
    scaled = {**base, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}
    with pytest.raises(hf.HFError, match="rope type 'llama3' is not supported; supported: default"):
        hf_checkpoint.model_config_from_hf(scaled)
    with pytest.raises(hf.HFError, match="rope type 'linear'"):
        hf_checkpoint.model_config_from_hf(
            {**base, "rope_scaling": {"type": "linear", "factor": 2.0}}
        )
    with pytest.raises(hf.HFError, match="hidden_act='gelu'"):
        hf_checkpoint.model_config_from_hf({**base, "hidden_act": "gelu"})
    cfg, flat = hf_checkpoint.load_hf_checkpoint(checkpoints["llama"][1])
    tensors = hf_checkpoint.flat_to_hf(flat, cfg)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(32, np.float32)
    with pytest.raises(hf.HFError, match="o_proj.bias is non-zero"):
        hf_checkpoint.hf_to_flat(tensors, cfg)
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)  # accepted
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(
        hf.HFError,
        match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*"
        r"unexpected \['model.extra.weight'\]",
    ):
        hf_checkpoint.hf_to_flat(tensors, cfg)
    with pytest.raises(hf.HFError, match="no weights in"):
        hf_checkpoint.load_hf_tensors(tmp_path)
    with pytest.raises(hf.HFError, match="cannot export as Qwen2ForCausalLM"):
        hf_checkpoint.hf_config_from_model(ModelConfig(), family="Qwen2ForCausalLM")


def test_safetensors_reader_matches_library(tmp_path):
    from safetensors.torch import save_file

    t = {"a": torch.randn(3, 5), "b": torch.randn(4).to(torch.bfloat16), "c": torch.arange(6)}
    save_file(t, tmp_path / "x.safetensors")
    got = hf_checkpoint.read_safetensors(tmp_path / "x.safetensors")
    assert got.keys() == t.keys()
    for k, v in t.items():
        np.testing.assert_array_equal(np.asarray(got[k], np.float64), v.double().numpy())
    hf_checkpoint.write_safetensors(
        tmp_path / "y.safetensors", {k: np.asarray(v) for k, v in got.items()}
    )
    from safetensors.torch import load_file

    back = load_file(tmp_path / "y.safetensors")
    assert all(torch.equal(back[k], t[k]) for k in t)


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tokenizer_dir(path: Path, chat: bool) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["What is 12 + 35? The answer is 47.", "hello world, how are you?", "use 3 5 7"]
    tok.train_from_iterator(corpus * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    tcfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    if chat:
        tcfg.update(
            eos_token={"__type": "AddedToken", "content": "<|im_end|>", "special": True},
            chat_template=CHATML,
        )
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return path


@pytest.mark.parametrize("chat", [False, True])
def test_tokenizer_adapter_matches_transformers(tmp_path, chat):
    from pipeline.tokenizer import Tokenizer

    d = make_tokenizer_dir(tmp_path / "tok", chat)
    ours = hf_tokenizer.load_tokenizer(d)
    ref = transformers.AutoTokenizer.from_pretrained(d)
    assert isinstance(ours, Tokenizer)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    assert ours.vocab_size == len(ref) == 300
    text = "What is 12 + 35? hello"
    assert ours.encode(text) == ref(text, add_special_tokens=False).input_ids
    assert ours.decode(ours.encode(text) + [ours.eos_id, ours.pad_id]) == text
    assert ours.decode([*ours.encode("hi"), 10_000]) == "hi\ufffd"
    assert ours.encode_completion("47")[-1] == ours.eos_id
    if chat:
        msgs = [{"role": "user", "content": text}]
        rendered = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(msgs) == rendered
        assert rendered.endswith("<|im_start|>assistant\n")
        assert ours.encode_prompt(text) == ref(rendered, add_special_tokens=False).input_ids
    else:
        assert ours.encode_prompt(text) == ref(text).input_ids  # BOS from the post-processor
        assert ours.encode_prompt(text)[0] == ours.bos_id == 1


def test_cli_import_into_new_run_then_export(checkpoints, tmp_path):
    from pipeline.paramserver import ParamServer
    from pipeline.run import Run, RunError, base_server
    from tpu_jobs.model.state import flat_to_params, new_model, params_to_flat

    hf_model, path = checkpoints["qwen3"]
    make_tokenizer_dir(path, chat=True)
    run_url = str(tmp_path / "run")
    small = ["task.num_train=64", "task.num_eval=8", "trainer.lr=1e-5"]
    assert hf.main(["import", str(path), "--run", run_url, *small]) == 0
    run = Run.open(run_url)
    assert run.config.model.qk_norm and run.config.model.head_dim == 16
    assert run.config.trainer.lr == 1e-5 and run.has_problems("train")
    snap = base_server(run).pull(0)
    assert snap.metadata["architecture"] == "Qwen3ForCausalLM"
    _, expected = hf_checkpoint.load_hf_checkpoint(path)
    assert all(np.array_equal(snap.tensors[k], expected[k]) for k in expected)
    # The trainer's load path: flat tensors into a fresh model of the run's config.
    fns, params = new_model(run.config.model, 0)
    flat = params_to_flat(fns, flat_to_params(fns, params, snap.tensors))
    assert all(np.array_equal(flat[k], expected[k]) for k in expected)
    assert hf.main(["import", str(path), "--run", run_url]) == 0  # idempotent

    # A "trained" version in the run's own parameter server, exported with the tokenizer.
    trained = {k: v * 1.01 for k, v in expected.items()}
    ps = ParamServer(run.store)
    ps.publish(3, trained, epoch=ps.acquire_epoch())
    out = tmp_path / "export"
    assert hf.main(["export", "--run", run_url, "--version", "3", "--out", str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (
        torch.equal(reloaded.model.norm.weight, torch.tensor(trained["norm.weight"]))
        and reloaded.config.eos_token_id == hf_model.config.eos_token_id
    )
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_run_tokenizer(run)  # the adapter from the copies stored with the run
    assert ours is not None and ours.eos_id == tok.eos_token_id
    assert (
        ours.encode_prompt("hi")
        == tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True
        )["input_ids"]
    )
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert hf.main(["export", "--run", run_url, "--base", "--out", str(tmp_path / "b")]) == 0
    _, base_again = hf_checkpoint.load_hf_checkpoint(tmp_path / "b")
    assert all(np.array_equal(base_again[k], expected[k]) for k in expected)

    # A run of another architecture refuses the import, naming the differing fields.
    with pytest.raises(RunError, match=r"has another .* model.qk_norm=True \(checkpoint: False\)"):
        hf.import_to_run(checkpoints["llama"][1], run_url)
    other = tmp_path / "other"
    with pytest.raises(RunError, match=r"would have .* model.qk_norm=False \(checkpoint: True\)"):
        hf.import_to_run(path, str(other), overrides=["model.qk_norm=false", *small])
    assert not other.exists() or not any(other.iterdir())  # nothing was created


# --------------------------------------------------------------------------------------
# model.tokenizer=hf: every role encodes with the imported tokenizer


def make_char_level_tokenizer_dir(path: Path) -> tuple[Path, int]:
    """A WordLevel tokenizer.json with one token per character of the project's CHARSET
    (so every task prompt is encodable) and newline, ChatML specials and template; EOS is
    <|im_end|> as in chat models. Returns (directory, vocabulary size)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from pipeline.tokenizer import CHARSET

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chat = ["<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *dict.fromkeys([*CHARSET, "\n"]), *chat])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True) for t in [*specials, *chat]])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    tcfg = {
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return path, len(vocab)


def test_imported_tokenizer_is_used_by_the_rollout_worker(tmp_path):
    from pipeline.paramserver import ParamServer
    from pipeline.run import Run, base_server
    from pipeline.tokenizer import CharTokenizer
    from tpu_jobs.model.batching import round_up
    from tpu_jobs.rollout_worker import RolloutWorker
    from tpu_jobs.trainer import Trainer

    tok_dir, vocab = make_char_level_tokenizer_dir(tmp_path / "tok")
    im_start, im_end = vocab - 2, vocab - 1
    path = tmp_path / "ckpt"
    build_hf("qwen2", vocab_size=vocab, eos_token_id=im_end).save_pretrained(path)
    for f in tok_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    small = [
        "task.num_train=32",
        "task.num_eval=4",
        "rollout.prompts_per_batch=2",
        "rollout.group_size=4",
        "sampler.max_new_tokens=24",
    ]
    run_url = str(tmp_path / "run")
    assert hf.main(["import", str(path), "--run", run_url, *small]) == 0
    run = Run.open(run_url)
    assert run.config.model.tokenizer == "hf" and run.config.model.vocab_size == vocab
    ps = ParamServer(run.store)  # v0 for the worker (the trainer's first publish)
    ps.publish(0, base_server(run).pull(0).tensors, epoch=ps.acquire_epoch())

    worker = RolloutWorker(run, "w")
    tok = worker.tok
    assert isinstance(tok, hf_tokenizer.HFTokenizer) and (tok.eos_id, tok.pad_id) == (im_end, 0)
    assert worker.sampler.eos_id == im_end
    worker._ensure_version(0)
    batch = worker.generate_batch(0, 0)
    # From the tokenizer files alone: next to a Qwen2 config.json, transformers 5 rebuilds
    # its own Qwen2Tokenizer pipeline instead of reading this tokenizer.json.
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    prompts = {p.problem_id: p.prompt for p in run.read_problems("train")}
    for i in range(len(batch)):
        chat = [{"role": "user", "content": prompts[batch.prompt_id[i]]}]
        expected = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        assert batch.prompt_ids[i] == expected["input_ids"]  # chat template applied
        assert batch.prompt_ids[i][0] == im_start and ref.unk_token_id not in expected["input_ids"]
        ids, text = batch.completion_ids[i], batch.completion[i]
        kept = [t for t in ids if t not in (tok.pad_id, tok.bos_id, tok.eos_id)]
        assert text == ref.decode(kept, skip_special_tokens=False)
        assert tok.encode(text) == kept  # the completion round-trips
    assert sum(map(len, batch.completion_ids)) > 40
    # The trainer sizes its prompts with the same tokenizer.
    trainer = Trainer(run, log=lambda m: None)
    longest = max(len(tok.encode_prompt(p)) for p in prompts.values())
    assert trainer.prompt_len == round_up(longest, 8)
    assert longest > max(len(CharTokenizer().encode_prompt(p)) for p in prompts.values()) + 10


def test_hf_tokenizer_needs_an_imported_tokenizer_json(checkpoints, tmp_path):
    from pipeline.run import Run

    _, path = checkpoints["llama"]  # no tokenizer files
    url = str(tmp_path / "run")
    with pytest.raises(hf.HFError, match=r"has no tokenizer.json.*model.tokenizer=hf"):
        hf.import_to_run(path, url, overrides=["model.tokenizer=hf", "task.num_train=8"])
    hf.import_to_run(path, url, overrides=["task.num_train=8", "task.num_eval=4"], log=print)
    run = Run.open(url)
    assert run.config.model.tokenizer == "char"  # nothing imported: the char tokenizer
    assert run_tokenizer(run).vocab_size == get_tokenizer("char").vocab_size
    forced = Run(url=run.url, store=run.store, config=_with_tokenizer(run, "hf"))
    with pytest.raises(hf.HFError, match=r"model.tokenizer=hf but .*rlax import-hf"):
        run_tokenizer(forced)


def _with_tokenizer(run, tokenizer: str):
    from dataclasses import replace

    return replace(run.config, model=replace(run.config.model, tokenizer=tokenizer))
