"""Tokenizer: parity with transformers on the real SmolLM2 GGUF, save/load round trips, errors."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import gguf
import pytest
import tokenizers
from tiny_tokenizer import byte_alphabet, make_byte_tokenizer
from tokenizers.models import BPE
from transformers import AutoTokenizer

from specdecode.errors import UserError
from specdecode.model.tokenizer import Tokenizer, tokenizer_from_gguf

TEXTS = [
    "Hello world",
    "hello 12345 world, pi is 3.14159 and 1,000,000",
    "  leading and trailing spaces  ",
    " x",
    "",
    "\n",
    "def f(x):\n\tif x:\n        return [1, 2]\n\n\n# done\r\n",
    "café naïve Ünïcödé résumé Ωμέγα Привет мир",
    "日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  <|im_end|>  <|endoftext|>text",
    "I'm sure you're fine, they'LL say DON'T",
    "a\u00a0b\u2003c\ttab\x00nul",
    "x" * 300,
]
CONVERSATIONS = {
    "no_system": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke 😀"},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
}


@pytest.fixture(scope="module")
def smol(smollm2_gguf: Path) -> Tokenizer:
    return tokenizer_from_gguf(gguf.GGUFReader(smollm2_gguf))


@pytest.fixture(scope="module")
def smol_reference(smollm2_gguf_alone: Path):
    """transformers' own tokenizer read from the GGUF alone (not from our converted files)."""
    return AutoTokenizer.from_pretrained(
        smollm2_gguf_alone.parent, gguf_file=smollm2_gguf_alone.name
    )


@pytest.mark.real_model
def test_smollm2_special_ids(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1  # <|im_start|>
    assert smol.eos_token_ids == (2, 0)  # <|im_end|> (GGUF eos), then <|endoftext|>
    assert not smol.add_bos
    assert smol.id_to_token(2) == "<|im_end|>" and smol.token_to_id("<|im_end|>") == 2


@pytest.mark.real_model
@pytest.mark.parametrize("text", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_smollm2_encode_decode_match_transformers(smol: Tokenizer, smol_reference, text: str):
    for add_special_tokens in (True, False):
        ids = smol.encode(text, add_special_tokens=add_special_tokens)
        assert ids == smol_reference.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert smol.decode(ids, skip) == smol_reference.decode(ids, skip_special_tokens=skip)
    assert smol.decode(ids, skip_special_tokens=False) == text


@pytest.mark.real_model
def test_smollm2_special_tokens_stay_whole(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids) == "user\nhi"


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(
    smol: Tokenizer, smol_reference, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = smol_reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs


@pytest.mark.real_model
def test_smollm2_save_round_trip(smol: Tokenizer, tmp_path: Path) -> None:
    smol.save(tmp_path)
    loaded = Tokenizer.from_folder(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    for attribute in ("vocab_size", "bos_token_id", "eos_token_ids", "pad_token_id", "add_bos"):
        assert getattr(loaded, attribute) == getattr(smol, attribute), attribute
    assert loaded.chat_template == smol.chat_template
    for text in TEXTS:
        assert loaded.encode(text) == smol.encode(text) == reference.encode(text)
    messages = CONVERSATIONS["system"]
    assert loaded.apply_chat_template(messages) == reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def write_tiny_gguf(
    path: Path, model: str = "gpt2", pre: str = "gpt2", add_bos: bool = True
) -> Path:
    """A GGUF holding only tokenizer metadata: bytes, a few merges, control and user tokens."""
    merged = ["Ġt", "he", "Ġthe", "in", "Ġthere"]  # 'Ġthere' is reachable only whole
    controls = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>"]
    tokens = [*byte_alphabet(), *merged, *controls, "<think>"]
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he", "i n"])
    writer.add_token_types([1] * (256 + len(merged)) + [3] * len(controls) + [4])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eot_token_id(tokens.index("<|eot_id|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(
        "{% for m in messages %}{{ bos_token + m.content + eos_token }}{% endfor %}"
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe"])
def test_tiny_gguf_matches_transformers(tmp_path: Path, pre: str) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre)
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert ours.add_bos and ours.id_to_token(ours.bos_token_id) == "<|im_start|>"
    # eos, eot, then the chat end-of-turn control tokens in END_OF_TURN_TOKENS order
    assert [ours.id_to_token(i) for i in ours.eos_token_ids] == [
        "<|endoftext|>",
        "<|eot_id|>",
        "<|im_end|>",
    ]
    for text in ["the thin <think>then</think> 12345", "<|im_end|> é 日本 😀", " in\n\n  x"]:
        for add_special_tokens in (True, False):
            expected = theirs.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens) == expected
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_llama_bpe_keeps_whole_vocab_words(tmp_path: Path) -> None:
    """Llama 3's tokenizer.json sets ignore_merges: a pre-token found whole in the vocab is kept."""
    llama = tokenizer_from_gguf(
        gguf.GGUFReader(write_tiny_gguf(tmp_path / "l.gguf", pre="llama-bpe"))
    )
    gpt2 = tokenizer_from_gguf(gguf.GGUFReader(write_tiny_gguf(tmp_path / "g.gguf", pre="gpt2")))
    there = llama.token_to_id("Ġthere")
    assert llama.encode(" there", add_special_tokens=False) == [there]
    assert there not in gpt2.encode(" there", add_special_tokens=False)


def test_qwen2_normalizes_to_nfc(tmp_path: Path) -> None:
    """Qwen2's own tokenizer.json NFC-normalizes: 'e' + combining acute encodes as 'é'."""
    qwen = tokenizer_from_gguf(gguf.GGUFReader(write_tiny_gguf(tmp_path / "q.gguf", pre="qwen2")))
    assert qwen.encode("e\u0301", add_special_tokens=False) == qwen.encode("é", False)


def write_tiny_sentencepiece_gguf(path: Path) -> Path:
    """A GGUF holding a tiny Gemma-style SentencePiece vocabulary: control tokens, a
    user-defined newline, the 256 byte tokens and a few scored pieces ("▁" is a space)."""
    controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = {  # piece: score (a merge's rank is its result's score)
        "h": -20.0, "e": -21.0, "l": -22.0, "o": -23.0, "▁": -24.0, "w": -25.0, "r": -26.0,
        "d": -27.0, "he": -1.0, "ll": -2.0, "llo": -3.0, "hello": -4.0, "▁hello": -5.0,
        "or": -6.0, "▁w": -7.0, "<e": -8.0,
    }  # fmt: skip
    tokens = [*controls, "\n", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    writer = gguf.GGUFWriter(path, arch="gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * 7 + [0.0] * 256 + list(pieces.values()))
    writer.add_token_types([3] * len(controls) + [4] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    """Merges rebuilt from the scores, byte fallback for text without pieces, control tokens
    whole (never merged into: '<e' + ... stays apart from '<end_of_turn>'), Gemma's end of
    turn among the eos ids, and Gemma's chat template for a file without one."""
    path = write_tiny_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    texts = ["hello world", " hello", "héllo\nwörld", "<start_of_turn>hello<end_of_turn>", "<e"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == text.replace("<start_of_turn>", "").replace("<end_of_turn>", "")
    assert ours.encode(" hello", add_special_tokens=False) == [ours.token_to_id("▁hello")]
    assert [ours.id_to_token(i) for i in ours.eos_token_ids] == ["<eos>", "<end_of_turn>"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(chat) == (
        "<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize(
    ("model", "pre", "message"),
    [("bert", "gpt2", "'bert' is not supported"), ("gpt2", "mystery", "'mystery' is not")],
)
def test_unsupported_gguf_tokenizers(tmp_path: Path, model: str, pre: str, message: str) -> None:
    path = write_tiny_gguf(tmp_path / "bad.gguf", model=model, pre=pre)
    with pytest.raises(ValueError, match=message):
        tokenizer_from_gguf(gguf.GGUFReader(path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return make_byte_tokenizer(tmp_path_factory.mktemp("tiny"))


def test_tiny_tokenizer_layout(tiny: Tokenizer, tmp_path: Path) -> None:
    assert tiny.vocab_size == 300
    assert [tiny.id_to_token(i) for i in (256, 257, 258, 299)] == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|reserved_299|>",
    ]
    assert tiny.eos_token_ids == (258,)
    assert tiny.encode("é", add_special_tokens=False) == [0xC3, 0xA9]  # every byte its own token
    rendered = tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert make_byte_tokenizer(tmp_path, vocab_size=1000).vocab_size == 1000
    with pytest.raises(ValueError, match="at least 259"):
        make_byte_tokenizer(tmp_path, vocab_size=100)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user"}], r"messages\[0\] needs a str 'content'"),
        (
            [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}],
            r"\[1\] needs a str 'role'",
        ),
    ],
)
def test_bad_messages(tiny: Tokenizer, messages, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny.apply_chat_template(messages)


def with_template(tiny: Tokenizer, folder: Path, template: str | None) -> Tokenizer:
    """`tiny` saved to `folder` with its chat template replaced, loaded back."""
    tiny.save(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": template}))
    return Tokenizer.from_folder(folder)


def test_chat_template_errors(tiny: Tokenizer, tmp_path: Path) -> None:
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        with_template(tiny, tmp_path / "none", None).apply_chat_template(hi)
    strict = with_template(tiny, tmp_path / "strict", "{{ raise_exception('no users here') }}")
    with pytest.raises(ValueError, match="rejected these messages: no users here"):
        strict.apply_chat_template(hi)


def test_bad_ids_and_text(tiny: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"token id 300 is outside the vocabulary \[0, 300\)"):
        tiny.decode([1, 300])
    with pytest.raises(ValueError, match="token id -1"):
        tiny.decode([-1])
    with pytest.raises(TypeError, match="must be an int"):
        tiny.decode([1.5])
    with pytest.raises(TypeError, match="takes a str"):
        tiny.encode(b"bytes")
    with pytest.raises(UserError, match=r"lone UTF-16 surrogate \('.{6}' at character 2\)"):
        tiny.encode("ab\udc00")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(ValueError, match="needs a bos_token_id"):
        Tokenizer(tokenizers.Tokenizer(BPE()), bos_token_id=None, eos_token_ids=[], add_bos=True)


def test_encode_lets_other_threads_run(tiny: Tokenizer) -> None:
    """A long text's encode releases the GIL: a thread beside it keeps ticking (with the GIL
    held for the whole encode, it would tick about once)."""
    text = "the cat sat on the mat " * 60_000  # ~1.4 MB: about a second of encoding
    ticks: list[int] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(1)
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    before = len(ticks)
    ids = tiny.encode(text, add_special_tokens=False)
    during = len(ticks) - before
    done.set()
    ticker.join()
    assert len(ids) == len(text)  # one token per byte
    assert during >= 20


QWEN_GGUF = os.environ.get("SPECDECODE_QWEN_GGUF")


@pytest.mark.skipif(QWEN_GGUF is None, reason="set SPECDECODE_QWEN_GGUF to a Qwen2.5 GGUF file")
def test_qwen2_gguf_matches_transformers() -> None:
    """Manual check (slow, ~30 s): Qwen2.5 ('qwen2' pre-tokenizer) against transformers."""
    path = Path(QWEN_GGUF or "")
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:  # all NFC already: transformers' GGUF loader skips Qwen2's NFC step
        assert ours.encode(text) == theirs.encode(text)
    for messages in CONVERSATIONS.values():
        assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
