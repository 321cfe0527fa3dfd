import subprocess
import sys

import numpy as np
import pytest

from pipeline.config import ModelConfig, TaskConfig, from_dict
from pipeline.tasks import TASKS
from pipeline.tasks.base import SyntheticTask
from pipeline.tokenizer import (
    BOS_ID,
    CHARSET,
    EOS_ID,
    PAD_ID,
    REPLACEMENT,
    UNK_ID,
    CharTokenizer,
    Tokenizer,
    get_tokenizer,
)

TOK = get_tokenizer("char")


def test_special_ids_and_vocab_size():
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2) == (PAD_ID, BOS_ID, EOS_ID)
    assert UNK_ID == 3
    assert TOK.vocab_size == 4 + len(CHARSET) == 59
    assert TOK.vocab_size <= ModelConfig().vocab_size == 64
    ids = TOK.encode(CHARSET)
    assert ids == list(range(4, 4 + len(CHARSET)))
    assert isinstance(TOK, Tokenizer)


def test_encode_prompt_and_completion():
    # '0' is id 4, '+' is id 14, '#' is id 21 (their offsets in CHARSET plus 4 specials).
    assert TOK.encode("0+#") == [4, 14, 21]
    assert TOK.encode_prompt("12+3=") == [1, 5, 6, 14, 7, 20]
    assert TOK.encode_completion("#15") == [21, 5, 9, 2]
    assert (
        TOK.encode("") == [] and TOK.encode_prompt("") == [1] and TOK.encode_completion("") == [2]
    )


def test_unknown_characters_map_to_unk_and_never_raise():
    a, b = TOK.encode("a")[0], TOK.encode("b")[0]
    assert TOK.encode("a\u20acb") == [a, UNK_ID, b]  # euro sign
    assert TOK.encode("\uff11\uff12") == [UNK_ID, UNK_ID]  # full-width digits
    assert TOK.encode("A\u200f\U0001f600\t") == [UNK_ID] * 4  # upper case, RLM, emoji, tab


def test_decode_skips_specials_and_does_not_stop_at_eos():
    ids = [PAD_ID, BOS_ID, *TOK.encode("7+"), EOS_ID, *TOK.encode("8"), EOS_ID, PAD_ID]
    assert TOK.decode(ids) == "7+8"
    # UNK and ids outside the vocabulary (a 64-wide model can sample them) stay visible.
    assert TOK.decode([*TOK.encode("1"), UNK_ID, 60, 63, -1]) == "1" + REPLACEMENT * 4
    assert TOK.decode(np.array([5, 6], dtype=np.int32)) == "12"


@pytest.mark.parametrize(
    "name", sorted(n for n, t in TASKS.items() if isinstance(t, SyntheticTask))
)
def test_round_trip_of_every_prompt_and_teacher_solution(name):
    task = TASKS[name]
    rng = np.random.default_rng(7)
    cfg = from_dict(TaskConfig, {"arithmetic": {"max_digits": 8}, "countdown": {"numbers": 5}})
    noisy = cfg.options_for(name)
    clean = task.noiseless(noisy)
    for _ in range(300):
        p = task.sample_problem(rng, noisy)
        for text in (
            p.prompt,
            p.answer,
            task.teacher_solution(p, rng, clean),
            task.teacher_solution(p, rng, noisy),
        ):
            ids = TOK.encode(text)
            assert UNK_ID not in ids, text
            assert TOK.decode(ids) == text
            assert TOK.decode(TOK.encode_prompt(text)) == text
            assert TOK.decode(TOK.encode_completion(text)) == text


def test_registry():
    assert isinstance(get_tokenizer(), CharTokenizer)
    with pytest.raises(ValueError, match="allowed: char, byte"):
        get_tokenizer("bpe")
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("aa")


# ------------------------------------------------------------------ the byte tokenizer

REAL_TEXT = [
    "Find $\\frac{14}{3}$ of $\\sqrt{2}$: \\boxed{X}",
    "def Solve(s: str) -> int:\n\treturn len(s)  # ünïcødé, 中文, 🙂",
    "",
    "\x00\x7f",
]


@pytest.mark.parametrize("text", REAL_TEXT)
def test_byte_tokenizer_round_trips_any_text_as_its_utf8_bytes(text):
    tok = get_tokenizer("byte")
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 4 + 256
    ids = tok.encode(text)
    assert ids == [b + 4 for b in text.encode("utf-8")]  # Python's own UTF-8 as the reference
    assert tok.decode(tok.encode_prompt(text)) == text
    assert tok.decode(tok.encode_completion(text)) == text


def test_byte_tokenizer_decodes_broken_utf8_and_unknown_ids_visibly():
    tok = get_tokenizer("byte")
    cut = tok.encode("é")[:1]  # a sample that stopped inside a two-byte character
    assert tok.decode(tok.encode("a") + cut) == "a" + REPLACEMENT
    assert tok.decode([*tok.encode("a"), UNK_ID, 999, *tok.encode("b")]) == (
        "a" + 2 * REPLACEMENT + "b"
    )


def test_unrepresentable_names_exactly_the_characters_the_tokenizer_would_lose():
    from pipeline.tokenizer import unrepresentable

    assert unrepresentable(TOK, ["Find X in $\\{1,2\\}$", "abc"]) == "$FX\\{}"
    assert unrepresentable(TOK, ["12+3=15"]) == ""
    assert unrepresentable(get_tokenizer("byte"), REAL_TEXT) == ""


def test_the_byte_tokenizer_needs_its_vocabulary():
    with pytest.raises(ValueError, match=r"model\.vocab_size=64.*>= 260, the byte tokenizer"):
        ModelConfig(tokenizer="byte", vocab_size=64)
    assert ModelConfig(tokenizer="byte", vocab_size=260).vocab_size == 260


def test_the_tokenizer_package_stays_light():
    # Every job imports the run's tokenizer; a run on the char tokenizer must not pay for
    # the Hugging Face library (a native extension), its templates or JAX.
    code = (
        "import sys, pipeline.tokenizer.run, pipeline.tokenizer.hf; "
        "sys.exit(sorted({'tokenizers', 'jinja2', 'jax'} & set(sys.modules)) or 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
