"""Tokenizer and chat template: a thin wrapper over a Hugging Face `tokenizers.Tokenizer`.

Built from a Hugging Face folder (`Tokenizer.from_folder`) or from a GGUF file's `tokenizer.*`
metadata (`tokenizer_from_gguf`: byte-level BPE, or SentencePiece BPE from
`model.sentencepiece`). `Tokenizer.save` writes a Hugging Face folder that both
`Tokenizer.from_folder` and `transformers.AutoTokenizer` load to the same ids.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors

from specdecode.errors import ModelNotFoundError, UserError
from specdecode.model.gguf_vocab import CONTROL, add_whole_tokens, vocabulary
from specdecode.model.sentencepiece import sentencepiece_bpe

# Chat end-of-turn tokens that end generation when a GGUF vocabulary has them as control tokens.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",  # Gemma
)

# Gemma's turn format, for GGUF files that carry no chat template (llama.cpp knows it by name):
# a system message opens the first user turn, the assistant's role is "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# GGUF general.architecture -> the chat template of files that carry none
DEFAULT_CHAT_TEMPLATES = {"gemma2": GEMMA_CHAT_TEMPLATE, "gemma3": GEMMA_CHAT_TEMPLATE}


_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreTokenization:
    """How one `tokenizer.ggml.pre` flavour cuts text before BPE merges run.

    Mirrors the model's own `tokenizer.json` (and llama.cpp's split for the same flavour).
    """

    nfc: bool = False  # NFC-normalize the text first (Qwen2)
    individual_digits: bool = False  # every digit its own pre-token (SmolLM2)
    split_regex: str | None = None  # None: GPT-2's own byte-level regex
    ignore_merges: bool = False  # a pre-token found whole in the vocab is kept whole (Llama 3)


PRE_TOKENIZATIONS: dict[str, PreTokenization] = {
    "gpt2": PreTokenization(),
    "smollm": PreTokenization(individual_digits=True),
    "qwen2": PreTokenization(nfc=True, split_regex=_QWEN2_SPLIT),
    "llama-bpe": PreTokenization(split_regex=_LLAMA3_SPLIT, ignore_merges=True),
}


class Tokenizer:
    """Text <-> token ids, plus chat-template rendering.

    Attributes:
        vocab_size: number of token ids, added tokens included (ids are `0..vocab_size-1`).
        bos_token_id: beginning-of-sequence id, or None when the model has none.
        eos_token_ids: every id that ends generation; the first is "the" eos token. Empty when the
            source names none.
        pad_token_id: padding id, or None.
        add_bos: whether `encode(text, add_special_tokens=True)` prepends `bos_token_id`.
        chat_template: Jinja source of the chat template, or None.
    All are read-only: the backend is configured from them once, at construction.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        """Wrap `backend`; its post-processor is replaced so that it adds BOS iff `add_bos`."""
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        named = [("bos_token_id", bos_token_id), ("pad_token_id", pad_token_id)]
        for name, token_id in named + [("eos_token_ids entry", i) for i in eos_token_ids]:
            if token_id is not None:
                self._check_id(token_id, name)
        if add_bos and bos_token_id is None:
            raise UserError("add_bos=True needs a bos_token_id, but the tokenizer has none")
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        bos = (self.id_to_token(bos_token_id), bos_token_id) if add_bos else None
        backend.post_processor = _bos_processor(bos)

    @classmethod
    def from_folder(cls, path: Path) -> Tokenizer:
        """Load a Hugging Face tokenizer folder.

        Reads `tokenizer.json` (required), `tokenizer_config.json` (bos/eos/pad tokens,
        `add_bos_token`, `chat_template`), `chat_template.jinja` if present, and the
        `bos_token_id`/`eos_token_id` of `generation_config.json` if present. The eos ids are the
        config's `eos_token` followed by the generation config's ids. Without `add_bos_token` in the
        config, `add_bos` is whether `tokenizer.json`'s own post-processor prepends BOS.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFoundError(
                f"{path} has no tokenizer.json (a Hugging Face tokenizer file)"
            )
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        bos_id = _config_token_id(backend, config, "bos_token")
        if bos_id is None:
            bos_id = generation.get("bos_token_id")
        eos_ids = [_config_token_id(backend, config, "eos_token")]
        generation_eos = generation.get("eos_token_id")
        eos_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = bos_id is not None and backend.encode("").ids[:1] == [bos_id]
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=[i for i in eos_ids if i is not None],
            pad_token_id=_config_token_id(backend, config, "pad_token"),
            add_bos=bool(add_bos),
            chat_template=_named_template(template),
        )

    def save(self, path: Path) -> None:
        """Write `tokenizer.json`, `tokenizer_config.json` and the token ids of
        `generation_config.json` (merged into an existing one) to the folder `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path / "tokenizer.json"))
        eos = self.eos_token_ids
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_or_none(self.bos_token_id),
            "eos_token": self._token_or_none(eos[0] if eos else None),
            "pad_token": self._token_or_none(self.pad_token_id),
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.chat_template,
        }
        _write_json(path / "tokenizer_config.json", config)
        generation = _read_json(path / "generation_config.json")
        generation.update(
            bos_token_id=self.bos_token_id, eos_token_id=list(eos), pad_token_id=self.pad_token_id
        )
        _write_json(path / "generation_config.json", generation)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text such as `<|im_end|>` maps to its own id.

        With `add_special_tokens`, BOS is prepended when `add_bos` is set. Other threads run
        meanwhile (the backend's batch call releases the GIL: a server's event loop is not held
        for the seconds a long text takes). Raises UserError for text that is not valid Unicode
        (a lone UTF-16 surrogate such as '\\ud800', which JSON's escapes can carry).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        check_unicode(text, "the text")
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (control tokens) are dropped if `skip_special_tokens`.

        An incomplete UTF-8 sequence (a character cut across tokens) decodes to U+FFFD.
        """
        token_ids = [self._check_id(i, "token id") for i in ids]
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The Hugging Face `tokenizers` object behind this one (read it; do not change it)."""
        return self._backend

    def vocab(self) -> dict[str, int]:
        """Every token string with its id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary entry spelled `token` (byte-level spelling), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary spelling of `token_id` (byte-level spelling, e.g. 'Ġhello')."""
        token = self._backend.id_to_token(self._check_id(token_id, "token id"))
        if token is None:
            raise UserError(f"token id {token_id} has no entry in the vocabulary")
        return token

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render `messages` (dicts with str 'role' and 'content', and whatever else the
        template reads, e.g. an assistant's 'tool_calls') to prompt text; `tools`: the
        functions offered, in OpenAI's request shape (the template's `tools`).

        Same output as transformers' `apply_chat_template(..., tools=tools, tokenize=False)`.
        """
        _check_messages(messages)
        special = {"bos_token": self.bos_token_id, "pad_token": self.pad_token_id}
        special["eos_token"] = self.eos_token_ids[0] if self.eos_token_ids else None
        names = {name: self.id_to_token(i) for name, i in special.items() if i is not None}
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **names,
            )
        except jinja2.TemplateError as error:
            raise UserError(f"the chat template rejected these messages: {error}") from error

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise UserError(
                "this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json "
                "or 'tokenizer.chat_template' in the GGUF file); format the prompt yourself"
            )
        return _compile_template(self.chat_template)

    def _check_id(self, token_id: int, what: str) -> int:
        try:
            index = operator.index(token_id)
        except TypeError:
            raise TypeError(f"{what} must be an int, got {type(token_id).__name__}") from None
        if not 0 <= index < self.vocab_size:
            raise UserError(f"{what} {index} is outside the vocabulary [0, {self.vocab_size})")
        return index

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.id_to_token(token_id)


def check_unicode(text: str, what: str) -> None:
    """UserError naming `what` when `text` is not valid Unicode: it holds a lone UTF-16
    surrogate (U+D800..U+DFFF), which no UTF-8 text can and JSON's \\uXXXX escapes can.

    Example: check_unicode("a\\ud800b", "the prompt") raises "the prompt holds a lone UTF-16
    surrogate ('\\ud800' at character 1): ..."
    """
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise UserError(
            f"{what} holds a lone UTF-16 surrogate ({text[error.start]!r} at character "
            f"{error.start}): text must be valid Unicode (a surrogate is only half of a pair)"
        ) from None


def tokenizer_from_gguf(reader: gguf.GGUFReader) -> Tokenizer:
    """Build the tokenizer a GGUF file describes (`tokenizer.ggml.model` 'gpt2': byte-level BPE;
    'llama': SentencePiece BPE, `model.sentencepiece`).

    Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
    tokens; both always match whole in text. `eos_token_ids` is, in order and without repeats:
    `tokenizer.ggml.eos_token_id`, `tokenizer.ggml.eot_token_id`, then every control token of
    `END_OF_TURN_TOKENS` present in the vocabulary. A missing `tokenizer.ggml.pre` means plain
    GPT-2 pre-tokenization (as transformers does); a missing `add_bos_token` means False. A
    file without `tokenizer.chat_template` gets its architecture's `DEFAULT_CHAT_TEMPLATES`
    entry, if any.
    """
    model = _field(reader, "tokenizer.ggml.model")
    tokens: list[str] | None = _field(reader, "tokenizer.ggml.tokens")
    if model not in ("gpt2", "llama"):
        raise UserError(
            f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level "
            "BPE), 'llama' (SentencePiece BPE)"
        )
    if tokens is None:
        raise UserError("GGUF file lacks 'tokenizer.ggml.tokens'")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "llama":
        scores: list[float] | None = _field(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise UserError("a SentencePiece GGUF vocabulary needs 'tokenizer.ggml.scores'")
        prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        backend = sentencepiece_bpe(tokens, scores, token_types, prefix)
    else:
        pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
        if pre not in PRE_TOKENIZATIONS:
            raise UserError(
                f"GGUF pre-tokenizer {pre!r} is not supported; "
                f"supported: {sorted(PRE_TOKENIZATIONS)}"
            )
        merges: list[str] | None = _field(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise UserError("GGUF file lacks 'tokenizer.ggml.merges'")
        backend = byte_level_bpe(tokens, merges, token_types, PRE_TOKENIZATIONS[pre])
    template = _field(reader, "tokenizer.chat_template")
    if template is None:
        template = DEFAULT_CHAT_TEMPLATES.get(_field(reader, "general.architecture"))
    control = {tokens[i]: i for i, kind in enumerate(token_types) if kind == CONTROL}
    eos_ids = [_field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot")]
    eos_ids += [control.get(token) for token in END_OF_TURN_TOKENS]
    return Tokenizer(
        backend,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[i for i in eos_ids if i is not None],
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=template,
    )


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    pre: PreTokenization,
) -> tokenizers.Tokenizer:
    """A byte-level BPE backend: token `i` is `tokens[i]` (byte-level spelling, 'Ġ' for a space),
    `merges` are 'left right' strings best-first, `token_types` are llama.cpp token types."""
    vocab = vocabulary(tokens, token_types)
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise UserError("every merge must be two tokens separated by one space, like 'Ġ t'")
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
    backend = tokenizers.Tokenizer(bpe)
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.split_regex is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split_regex), behavior="isolated"))
    use_regex = pre.split_regex is None
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    backend.decoder = decoders.ByteLevel()
    add_whole_tokens(backend, tokens, token_types)
    return backend


def _bos_processor(bos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """Post-processor prepending `bos` = (token, id), or adding nothing for None; the same
    template transformers builds for `add_bos_token`."""
    if bos is None:
        return processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    token = bos[0]
    return processors.TemplateProcessing(
        single=f"{token}:0 $A:0", pair=f"{token}:0 $A:0 {token}:1 $B:1", special_tokens=[bos]
    )


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with path.open(encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON: {err}") from err


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def _config_token_id(
    backend: tokenizers.Tokenizer, config: dict[str, Any], name: str
) -> int | None:
    """Id of a `tokenizer_config.json` token entry: a string or an `{"content": ...}` dict."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return None
    token_id = backend.token_to_id(value)
    if token_id is None:
        raise UserError(f"tokenizer_config.json {name} {value!r} is not in the vocabulary")
    return token_id


def _named_template(template: str | list[dict[str, str]] | None) -> str | None:
    """The template source; from a list of named templates, the one named 'default'."""
    if template is None or isinstance(template, str):
        return template
    named = {entry.get("name"): entry.get("template") for entry in template}
    if "default" not in named:
        raise UserError(f"no chat template named 'default' among {sorted(named)}")
    return named["default"]


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise UserError(f"messages[{index}] needs a str {key!r}, got {message.get(key)!r}")


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Jinja's `tojson` without HTML escaping, with transformers' options."""
    options = {"indent": indent, "separators": separators, "sort_keys": sort_keys}
    return json.dumps(value, ensure_ascii=ensure_ascii, **options)
