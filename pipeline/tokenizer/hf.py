"""The Hugging Face tokenizer: the adapter from a checkpoint's `tokenizer.json` (and its
chat template) to the project's `Tokenizer` protocol (`pipeline.tokenizer`).

The `tokenizers` library and jinja2 are imported only when a tokenizer is loaded or a
template compiled, so importing this module keeps `pipeline` light (no native library for
a run on the char tokenizer). `pipeline.tokenizer.run.run_tokenizer` picks it for a run
with `model.tokenizer=hf`; the HF import/export job (`tpu_jobs.hf`) shares its file names
and `HFError`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.tokenizer import REPLACEMENT, TokenizerBase

CONFIG_FILE = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


class HFError(ValueError):
    """A checkpoint is unsupported, incomplete or does not match the model/run."""


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, Mapping):  # a serialised AddedToken
        return tok.get("content")
    return tok


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


class HFTokenizer(TokenizerBase):
    """A `tokenizers.Tokenizer` (tokenizer.json) behind the project's Tokenizer protocol.

    Special ids come from tokenizer_config.json (bos/eos/pad tokens), else from the model's
    config.json token ids. Without a pad token the EOS id pads; without a BOS token
    `bos_id` is the config's bos_token_id (or EOS) but prompts get no BOS. `encode_prompt`
    renders the chat template (a single user turn plus the generation prompt) when the
    checkpoint has one and `use_chat_template` is true, else prepends BOS when the
    tokenizer adds one itself (tokenizer.json post-processor or `add_bos_token`).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token: str | None = None,
        bos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        model_config: Mapping[str, Any] | None = None,
        add_bos: bool | None = None,
        use_chat_template: bool = True,
    ):
        self.tokenizer = tokenizer
        mc = dict(model_config or {})
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token

        def tid(token: str | None, fallback: Any) -> int | None:
            if token is not None:
                i = tokenizer.token_to_id(token)
                if i is None:
                    raise HFError(f"special token {token!r} is not in the tokenizer's vocabulary")
                return int(i)
            return _first_id(fallback)

        eos = tid(eos_token, mc.get("eos_token_id"))
        if eos is None:
            raise HFError("no EOS token: tokenizer_config.json and config.json define none")
        self.eos_id: int = eos
        bos = tid(bos_token, mc.get("bos_token_id"))
        self.has_bos = bos is not None
        self.bos_id: int = eos if bos is None else bos
        pad = tid(pad_token, mc.get("pad_token_id"))
        self.pad_id: int = eos if pad is None else pad
        # Like transformers: BOS when tokenizer.json's post-processor adds one, or when
        # tokenizer_config.json says add_bos_token=true.
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        adds_bos = bool(probe) and bos is not None and probe[0] == bos
        self.add_bos = (adds_bos or bool(add_bos)) and bos is not None
        self.chat_template = chat_template
        self.use_chat_template = use_chat_template
        self._skip = {self.pad_id, self.bos_id, self.eos_id}
        # The model's UNK (WordPiece/WordLevel/Unigram models have one; byte-level BPE
        # does not), for `pipeline.tokenizer.unrepresentable`.
        unk = getattr(tokenizer.model, "unk_token", None)
        self.unk_id: int | None = tokenizer.token_to_id(unk) if unk else None

    @classmethod
    def from_dir(cls, directory: str | Path, **kwargs: Any) -> HFTokenizer:
        from tokenizers import Tokenizer

        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise HFError(f"{d / 'tokenizer.json'} not found (only fast tokenizers are supported)")
        tcfg: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later wins
            if (d / name).is_file():
                tcfg.update(json.loads((d / name).read_text()))
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        model_config = (
            json.loads((d / CONFIG_FILE).read_text()) if (d / CONFIG_FILE).is_file() else {}
        )
        add_bos = tcfg.get("add_bos_token")
        kw = dict(
            eos_token=_token_content(tcfg.get("eos_token")),
            bos_token=_token_content(tcfg.get("bos_token")),
            pad_token=_token_content(tcfg.get("pad_token")),
            chat_template=template,
            model_config=model_config,
            add_bos=None if add_bos is None else bool(add_bos),
        )
        kw.update(kwargs)
        return cls(Tokenizer.from_file(str(d / "tokenizer.json")), **kw)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Skips PAD/BOS/EOS; ids outside the vocabulary become U+FFFD."""
        vocab = self.vocab_size
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            i = int(i)
            if i in self._skip:
                continue
            if 0 <= i < vocab:
                run.append(i)
                continue
            parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
            parts.append(REPLACEMENT)
            run = []
        parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(parts)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The chat template rendered like transformers' `apply_chat_template(tokenize=False)`."""
        if not self.chat_template:
            raise HFError("this tokenizer has no chat template (tokenizer_config.json)")
        return _render_template(
            self.chat_template,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
        )

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_template and self.use_chat_template:
            return self.encode(self.apply_chat_template([{"role": "user", "content": text}]))
        return ([self.bos_id] if self.add_bos else []) + self.encode(text)


def _render_template(template: str, **context: Any) -> str:
    """Jinja rendering with the environment transformers uses for chat templates."""
    return _compile_template(template).render(**context)


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> Any:
    """The compiled chat template (compiling costs ~1000x a render; roles encode every
    problem's prompt)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise HFError(f"chat template error: {message}")

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators=None, sort_keys=False
    ):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        import datetime

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def load_tokenizer(directory: str | Path, **kwargs: Any) -> HFTokenizer:
    return HFTokenizer.from_dir(directory, **kwargs)
