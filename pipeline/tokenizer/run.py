"""The run's tokenizer: the one every role of a run encodes and decodes with.

`run_tokenizer(run)` builds what `model.tokenizer` names: a built-in tokenizer ("char",
"byte": `pipeline.tokenizer.TOKENIZERS`) or, for "hf", the one imported with the run's base
model (`base/hf/tokenizer.json`, `pipeline.tokenizer.hf.HFTokenizer`). The SFT, trainer,
rollout, evaluation, pass-rate and ORM jobs all get their tokenizer from it.

A module of its own, apart from the package's `__init__`, because it reads the run's
stores (`pipeline.run`), and `pipeline.config` imports the registry of the `__init__`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.layout import HF_PREFIX
from pipeline.tokenizer import TOKENIZERS, Tokenizer, get_tokenizer
from pipeline.tokenizer.hf import CONFIG_FILE, TOKENIZER_FILES, HFError, HFTokenizer


def load_run_tokenizer(run: Any, **kwargs: Any) -> HFTokenizer | None:
    """The tokenizer imported with the run's base model (`base/hf/`), or None if the base
    did not come from an HF checkpoint with a tokenizer.json."""
    import tempfile

    from pipeline.run import base_server
    from pipeline.storage import ObjectNotFound

    store = base_server(run).store.child(HF_PREFIX)
    with tempfile.TemporaryDirectory() as tmp:
        for name in (CONFIG_FILE, *TOKENIZER_FILES):
            try:
                (Path(tmp) / name).write_bytes(store.read(name))
            except ObjectNotFound:
                continue
        if not (Path(tmp) / "tokenizer.json").is_file():
            return None
        return HFTokenizer.from_dir(tmp, **kwargs)


def run_tokenizer(run: Any) -> Tokenizer:
    """The tokenizer every role of `run` uses (`model.tokenizer`): a built-in one, or
    for "hf" the one imported with the run's base model (`base/hf/tokenizer.json`; prompts
    rendered with its chat template when it has one)."""
    cfg = run.config.model
    if cfg.tokenizer in TOKENIZERS:  # built in: "char", "byte"
        return get_tokenizer(cfg.tokenizer)
    tok = load_run_tokenizer(run)
    if tok is None:
        raise HFError(
            f"run {run.url} has model.tokenizer=hf but its base has no imported tokenizer "
            f"(base/{HF_PREFIX}/tokenizer.json); import a checkpoint directory that holds "
            f"tokenizer.json (`rlax import-hf PATH --run NEW_RUN`), or use model.tokenizer=char"
        )
    if tok.vocab_size > cfg.vocab_size:
        raise HFError(
            f"run {run.url}: the imported tokenizer has {tok.vocab_size} tokens, more than "
            f"model.vocab_size={cfg.vocab_size} (the embedding rows); import a matching "
            "tokenizer.json with the checkpoint"
        )
    return tok
