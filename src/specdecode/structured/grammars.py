"""Compiling constraints with xgrammar for one tokenizer and model vocabulary.

Why xgrammar (measured on this CPU with Qwen2.5's 151,936-token vocabulary, a nested 5-field
schema, a 51-token output; docs/structured.md): a token mask takes 2.8 us median (40 us p90)
against llguidance's 27 / 86 us and outlines-core's 17 us, and speculation needs one mask per
draft position; its tokenizer set-up takes 0.6-0.8 s (llguidance 1.8 s); a schema compiles in
20-40 ms (outlines-core ~1.1 s), but in seconds when a string has a long maxLength (4.8-8.3 s
for 100-200: compiled grammars are cached); its matcher rolls back any number of tokens; bad
schemas, regexes and grammars raise a message that says what is wrong.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Collection
from functools import lru_cache
from typing import Any

from specdecode.errors import MissingDependencyError, UserError
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling_params import StructuredOutputsParams
from specdecode.structured.state import GrammarState

XGRAMMAR_REQUIREMENT = "xgrammar==0.2.8"
_COMPILED_CACHE = 64  # compiled grammars kept per tokenizer (by their parameters)
_LOOSE_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")  # as xgrammar prints them
_STRING_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:
        raise MissingDependencyError(
            f"structured output needs xgrammar: pip install {XGRAMMAR_REQUIREMENT} "
            "(or specdecode's 'structured' extra)"
        ) from err
    return xgrammar


class Grammars:
    """Compiles `StructuredOutputsParams` for one tokenizer and model vocabulary (`vocab_size`
    = the width of the model's logits, which may exceed the tokenizer's) and starts one
    `GrammarState` per request. The tokenizer's set-up (~0.7 s for 150k tokens) happens at the
    first constrained request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compile = lru_cache(maxsize=_COMPILED_CACHE)(self._compile_uncached)
        self._compiler: Any = None
        self._lock = threading.Lock()  # a server prepares requests beside the engine thread

    def start(self, params: StructuredOutputsParams, stop_ids: Collection[int]) -> GrammarState:
        """A fresh `GrammarState` for one request under `params`, ending with any of
        `stop_ids` (its end-of-sequence tokens). Raises UserError for a bad constraint."""
        if not stop_ids:
            raise UserError(
                "structured output ends with an end-of-sequence token, but this request has "
                "none (ignore_eos is set, or the tokenizer names no EOS): unset ignore_eos"
            )
        xgr = _xgrammar()
        matcher = xgr.GrammarMatcher(self._compile(params), override_stop_tokens=list(stop_ids))
        return GrammarState(matcher, self.vocab_size, self.tokenizer.vocab_size)

    def _compile_uncached(self, params: StructuredOutputsParams) -> Any:
        compiler = self._compiler_for_tokenizer()
        try:
            if params.json is not None or params.json_object:
                schema = params.json if params.json is not None else '{"type": "object"}'
                return compiler.compile_grammar(json_grammar(schema, params))
            if params.regex is not None:
                return compiler.compile_regex(params.regex)
            if params.choice is not None:
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as err:
            raise UserError(f"invalid {params.kind} constraint: {_message(err)}") from None

    def _compiler_for_tokenizer(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._new_compiler()
        return self._compiler

    def _new_compiler(self) -> Any:
        """xgrammar's compiler for this tokenizer (its vocabulary decoded once)."""
        xgr = _xgrammar()
        backend = self.tokenizer.backend
        encoded = [""] * self.tokenizer.vocab_size
        for token, index in backend.get_vocab(with_added_tokens=True).items():
            encoded[index] = token
        for index, added in backend.get_added_tokens_decoder().items():
            if added.special:  # control tokens: never text inside the output
                encoded[index] = ""
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        info = xgr.TokenizerInfo(
            encoded,
            meta["vocab_type"],
            vocab_size=self.vocab_size,
            stop_token_ids=list(self.tokenizer.eos_token_ids) or None,
            add_prefix_space=meta["add_prefix_space"],
        )
        # No cache inside xgrammar: `_compile` is the one cache, bounded by count (xgrammar's
        # own is unbounded by default and grew ~1.7 MB per distinct schema).
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compiler_cache_bytes(self) -> int:
        """Bytes xgrammar's compiler holds in its own cache (0: it keeps none)."""
        return 0 if self._compiler is None else int(self._compiler.get_cache_size_bytes())


def json_grammar(schema: str, params: StructuredOutputsParams) -> str:
    """xgrammar's EBNF grammar for a JSON schema, with the characters of its strings fixed.

    xgrammar 0.2.8 lets raw control characters into strings that have a maxLength, and UTF-16
    surrogates (which no valid UTF-8 text holds) into every string: JSON parsers then refuse
    the output, or read it with U+FFFD in place and too long. Both character classes become
    `_STRING_CHAR`, which leaves out controls, quote, backslash (escapes have their own rule)
    and surrogates.
    """
    grammar = _xgrammar().Grammar.from_json_schema(
        schema, any_whitespace=not params.disable_any_whitespace
    )
    text = str(grammar)
    for loose in _LOOSE_STRING_CHARS:
        text = text.replace(loose, _STRING_CHAR)
    return text


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of `choices`.

    Example: ("yes", 'say "no"') -> 'root ::= "yes" | "say \\"no\\""' (JSON string escapes,
    which the EBNF dialect reads the same way).
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _message(err: RuntimeError) -> str:
    """xgrammar's error without its C++ source location: '[12:00:01] x.cc:83: Regex parsing
    error ...' -> 'Regex parsing error ...'."""
    return _CPP_PREFIX.sub("", str(err).strip()).strip()
