"""IncrementalDetokenizer: streamed text never shows a broken character and adds up to decode()."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import gguf
import pytest
from tiny_tokenizer import make_byte_tokenizer

from specdecode.engine.detokenizer import IncrementalDetokenizer
from specdecode.model.tokenizer import Tokenizer, tokenizer_from_gguf

TEXTS = [
    "Hello, world! Plain ASCII text with numbers 12345.",
    "Café, naïve, Ünïcödé, résumé; Ωμέγα; Привет, мир!",
    "日本語のテキストと中文和한국어 mixed with English.",
    "Emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 and math ∑∫√ end.",
    "<|im_start|>user\nhi 🙂<|im_end|>\n<|im_start|>assistant\nこんにちは<|im_end|>",
    "def f(x):\n\treturn x  # ünïcode comment\n",
]


def stream(tokenizer: Tokenizer, ids: list[int], chunks: Sequence[int], skip: bool) -> list[str]:
    """Push `ids` in pieces of the given sizes (cycled), then flush; every returned piece."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces, start, index = [], 0, 0
    while start < len(ids):
        size = chunks[index % len(chunks)]
        pieces.append(detokenizer.push(ids[start : start + size]))
        start, index = start + size, index + 1
    pieces.append(detokenizer.flush())
    assert detokenizer.text == "".join(pieces)
    return pieces


def check_stream(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for chunks in ([1], [3], [2, 5, 1], [len(ids)]):
        for skip in (True, False):
            pieces = stream(tokenizer, ids, chunks, skip)
            assert not any("\ufffd" in piece for piece in pieces)
            assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path) -> Tokenizer:
    return tokenizer_from_gguf(gguf.GGUFReader(smollm2_gguf))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return make_byte_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_smollm2_stream(smol: Tokenizer, text: str) -> None:
    check_stream(smol, text)


@pytest.mark.parametrize("text", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_byte_tokenizer_stream(tiny: Tokenizer, text: str) -> None:
    check_stream(tiny, text)


def test_split_character_is_held_back(tiny: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tiny)
    pushed = [detokenizer.push([byte]) for byte in "h😀!".encode()]
    assert pushed == ["h", "", "", "", "😀", "!"]
    assert detokenizer.flush() == ""
    assert detokenizer.text == "h😀!"


def test_flush_emits_an_incomplete_tail(tiny: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tiny)
    assert detokenizer.push([ord("a"), 0xE6, 0x97]) == "a"  # 'a' + the first two bytes of 日
    assert detokenizer.push([0xA5]) == "日"
    assert detokenizer.push([0xE6, 0x97]) == ""
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == tiny.decode([ord("a"), 0xE6, 0x97, 0xA5, 0xE6, 0x97])


def test_special_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode("a<|im_end|>b", add_special_tokens=False)
    assert "".join(stream(tiny, ids, [1], skip=True)) == "ab"
    assert "".join(stream(tiny, ids, [1], skip=False)) == "a<|im_end|>b"


def test_random_ids_match_decode(tiny: Tokenizer) -> None:
    """Arbitrary ids, invalid UTF-8 and special tokens included: pieces add up to decode()."""
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.choice([rng.randrange(300), rng.randrange(0x80, 0x100)]) for _ in range(40)]
        chunks = [rng.randint(1, 5) for _ in range(3)]
        for skip in (True, False):
            pieces = stream(tiny, ids, chunks, skip)
            assert "".join(pieces) == tiny.decode(ids, skip_special_tokens=skip)


class CountingTokenizer:
    """Delegates to a Tokenizer, recording how many ids each decode() call saw."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self._tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self._tokenizer.decode(ids, skip_special_tokens)


def test_work_per_push_is_bounded(tiny: Tokenizer) -> None:
    counting = CountingTokenizer(tiny)
    detokenizer = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
    ids = tiny.encode("naïve 日本 😀 " * 200, add_special_tokens=False)
    for token_id in ids:
        detokenizer.push([token_id])
    assert detokenizer.text == tiny.decode(ids)
    assert max(counting.lengths) <= 8  # a 4-byte character held, plus the previous chunk


def test_bad_ids_leave_the_stream_usable(tiny: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tiny)
    assert detokenizer.push([ord("a")]) == "a"
    with pytest.raises(ValueError, match=r"token ids \[300\] are outside \[0, 300\)"):
        detokenizer.push([ord("b"), 300])
    with pytest.raises(TypeError):
        detokenizer.push([1.5])
    assert detokenizer.push([ord("c")]) == "c"
