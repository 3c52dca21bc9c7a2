"""Structured output: every output keeps its constraint, with and without speculation; greedy
speculative output equals plain output under the same constraint; sampling stays exact when
drafts break the grammar; bad constraints are clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from spec_cases import chi2_pvalue
from structured_cases import CHOICES, GRAMMARS, REGEXES, SCHEMAS
from test_speculative import example_config
from tiny_tokenizer import make_byte_tokenizer

from specdecode import LLM, SamplingParams, StructuredOutputsParams
from specdecode.drafters.registry import DRAFTERS
from specdecode.errors import UserError
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling.rejection import verify_chain
from specdecode.structured.drafts import constrain_drafts, mask_logits
from specdecode.structured.grammars import Grammars
from specdecode.structured.state import all_allowed, allows, forced_token
from specdecode.tree.token_tree import TokenTree
from specdecode.types import Draft

PROMPTS = [{"prompt_token_ids": [5, 17, 42, 99, 5, 17]}, {"prompt_token_ids": [7, 8, 9]}]
ALPHA = 1e-3


def _json(schema: dict, temperature: float = 0.0) -> SamplingParams:
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(
        temperature=temperature, seed=11, max_tokens=160, structured_outputs=constraint
    )


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def plain_outputs(plain: LLM) -> list[list[tuple[int, ...]]]:
    """Plain greedy outputs under each schema: [schema][prompt] -> token ids."""
    return [[o.token_ids for o in plain.generate(PROMPTS, _json(s))] for s in SCHEMAS]


def _check_valid(llm: LLM, schema: dict, params: SamplingParams) -> list[tuple[int, ...]]:
    outs = llm.generate(PROMPTS, params)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    return [o.token_ids for o in outs]


def test_plain_outputs_validate_against_every_schema(plain: LLM, plain_outputs) -> None:
    """22 schemas, greedy and sampled, without speculation: every output parses and validates
    (the plain greedy outputs are the fixture's)."""
    assert len(SCHEMAS) >= 20
    for schema, expected in zip(SCHEMAS, plain_outputs, strict=True):
        assert _check_valid(plain, schema, _json(schema)) == expected
        _check_valid(plain, schema, _json(schema, temperature=1.0))


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_every_drafter_keeps_every_schema_and_plain_greedy_output(
    tiny_model_dir: Path, plain_outputs, method: str
) -> None:
    """Under each of the 22 schemas, each drafter's greedy output equals plain constrained
    greedy output token for token (fp32) and validates; sampled outputs validate too."""
    config = example_config(method, tiny_model_dir)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)
    for schema, expected in zip(SCHEMAS, plain_outputs, strict=True):
        assert _check_valid(llm, schema, _json(schema)) == expected, schema
    for schema in SCHEMAS[::3]:
        _check_valid(llm, schema, _json(schema, temperature=1.0))


@pytest.mark.parametrize(
    "constraint, check",
    [
        *[({"regex": r}, lambda text, r=r: re.fullmatch(r, text)) for r in REGEXES],
        *[({"choice": c}, lambda text, c=c: text in c) for c in CHOICES],
        ({"grammar": GRAMMARS[0]}, lambda text: re.fullmatch(r"\([0-9x](,[0-9x])*\)", text)),
    ],
)
def test_regex_choice_and_grammar(
    plain: LLM, tiny_model_dir: Path, constraint: dict, check
) -> None:
    """Outputs match their regex, choice or grammar, plain and speculative (the greedy outputs
    equal)."""
    ngram = LLM(
        str(tiny_model_dir),
        dtype="float32",
        speculative_config=example_config("ngram", tiny_model_dir),
    )
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, seed=3, max_tokens=120, structured_outputs=constraint
        )
        outs = [llm.generate(PROMPTS, params) for llm in (plain, ngram)]
        for out in outs[0] + outs[1]:
            assert out.outputs[0].finish_reason == "stop" and check(out.text), out.text
        if temperature == 0.0:
            assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


@pytest.mark.parametrize(
    "constraint",
    [
        {"json_object": True},
        {
            "json": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "born": {"type": "integer"},
                    "fields": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["name", "born", "fields"],
                "additionalProperties": False,
            }
        },
    ],
)
def test_real_model_json_plain_and_speculative(smollm2_dir: Path, constraint: dict) -> None:
    """SmolLM2 with its chat template: the output is JSON (an object, or valid against the
    schema), and ngram and the model as its own draft give plain's greedy tokens."""
    messages = [
        {
            "role": "user",
            "content": "Ada Lovelace, born 1815, worked on mathematics and computing. "
            "Reply with a JSON object with her name and birth year.",
        }
    ]
    params = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=constraint)
    configs = [
        None,
        {"method": "ngram", "num_speculative_tokens": 8},
        {"method": "draft_model", "model": str(smollm2_dir), "num_speculative_tokens": 3},
    ]
    outs = [
        LLM(str(smollm2_dir), dtype="float32", speculative_config=c).chat(messages, params)[0]
        for c in configs
    ]
    value = json.loads(outs[0].text)
    assert isinstance(value, dict) and outs[0].outputs[0].finish_reason == "stop"
    if "json" in constraint:
        jsonschema.validate(value, constraint["json"])
    assert all(o.token_ids == outs[0].token_ids for o in outs[1:])


def test_forced_tokens_are_drafted_for_free(plain: LLM, tiny_model_dir: Path) -> None:
    """A constant leaves one token allowed at each position: with speculation the forced
    tokens ride in the drafts (fewer target passes than tokens), without it (K = 0) each
    takes its own pass; the output is the same."""
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        speculative_config=example_config("ngram", tiny_model_dir),
    )
    params = _json({"const": "a fixed answer, forced"})
    fast = llm.generate(PROMPTS[:1], params)[0]
    plain_out = plain.generate(PROMPTS[:1], params)[0]
    none = llm.generate(
        PROMPTS[:1],
        SamplingParams(
            temperature=0.0,
            max_tokens=160,
            num_speculative_tokens=0,
            structured_outputs=params.structured_outputs,
        ),
    )[0]
    assert fast.text == plain_out.text == none.text == '"a fixed answer, forced"'
    assert fast.metrics.spec.num_steps < len(fast.token_ids) / 2  # K = 4: up to 5 a pass
    assert none.metrics.spec.num_steps == len(none.token_ids)


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"json": {"type": "objekt"}}, "invalid json constraint: .*objekt"),
        ({"json": '{"type": "string", "minLength": 5, "maxLength": 2}'}, "invalid json"),
        ({"regex": "[a-"}, "invalid regex constraint: .*Unclosed"),
        ({"regex": "(ab"}, "invalid regex constraint: .*parenthesis"),
        ({"grammar": 'root ::= "a" | b'}, 'invalid grammar constraint: .*"b" is not defined'),
    ],
)
def test_bad_constraints_are_clear_errors(plain: LLM, constraint: dict, message: str) -> None:
    """A schema, regex or grammar the compiler refuses is a UserError naming the problem (no
    C++ source location), and the engine goes on serving."""
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=constraint)
    with pytest.raises(UserError, match=message) as info:
        plain.generate(PROMPTS[:1], params)
    assert ".cc:" not in str(info.value)
    assert len(plain.generate(PROMPTS[:1], SamplingParams(max_tokens=3))[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of json, json_object, regex, choice, grammar, got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": "{not json"}, "its text is not JSON"),
        ({"json": "[1]"}, "a JSON schema is an object or a bool"),
        ({"choice": []}, "choice must be a list of non-empty strings"),
        ({"choice": ["a", ""]}, "non-empty strings"),
        ({"choice": "yes"}, "choice must be a list of non-empty strings, got 'yes'"),
        ({"regex": 5}, "regex must be a non-empty string"),
    ],
)
def test_bad_structured_params(kwargs: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        StructuredOutputsParams(**kwargs)


def test_bad_sampling_params_with_a_constraint() -> None:
    with pytest.raises(UserError, match="no field \\['jsn'\\]"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(UserError, match="ignore_eos cannot be set"):
        SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True)
    with pytest.raises(UserError, match="StructuredOutputsParams or a dict"):
        SamplingParams(structured_outputs="json")


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> Grammars:
    tokenizer = make_byte_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300)
    return Grammars(tokenizer, vocab_size=320)  # the model's logits may be wider


def test_masks_refuse_control_characters_and_ids_beyond_the_tokenizer(grammars) -> None:
    """Inside a length-bounded JSON string raw control characters are refused (JSON forbids
    them; xgrammar 0.2.8 allowed them), and ids the tokenizer lacks are never allowed."""
    constraint = StructuredOutputsParams(json={"type": "string", "maxLength": 4})
    state = grammars.start(constraint, [258])
    assert state.advance(ord('"'))
    mask = all_allowed(1, 320)
    state.fill(mask, 0)
    assert allows(mask[0], ord("a")) and not allows(mask[0], 0x0F)
    assert not allows(mask[0], ord("\n")) and not any(allows(mask[0], t) for t in range(300, 320))


def test_forced_token_reads_a_single_bit() -> None:
    mask = torch.zeros(3, dtype=torch.int32)
    mask[1] = 8
    assert forced_token(mask) == 35
    mask[1] = 12
    assert forced_token(mask) is None
    mask[:] = 0
    mask[2] = -(2**31)
    assert forced_token(mask) == 95


def test_trees_keep_their_shape_and_get_masks_along_valid_paths(grammars) -> None:
    """A tree keeps every node (its drafter may read the target at each); the masks follow the
    valid paths and leave everything below a refused node all allowed (never reached)."""
    state = grammars.start(StructuredOutputsParams(regex="[ab]{3}"), [258])
    a, b, x = ord("a"), ord("b"), ord("x")
    # root -> a (0) -> b (2) -> x (4); root -> x (1) -> a (3)
    tree = TokenTree((-1, -1, 0, 1, 2))
    draft = Draft(torch.tensor([a, x, b, a, x]), None, tree)
    (out,), (masks,) = constrain_drafts([state], [draft], [5], 300)
    assert out is draft and masks.shape[0] == 6
    assert allows(masks[0], a) and not allows(masks[0], x)  # at the root
    assert allows(masks[3], b) and not allows(masks[3], x)  # after a, b: one more of [ab]
    assert allows(masks[2], x) and allows(masks[4], x)  # below the refused x: all allowed
    assert state.advance(a) and state.advance(b) and state.advance(a)  # state left at start


def test_chains_are_cut_or_kept_whole_for_drafters_that_read_the_target(grammars) -> None:
    """A deterministic chain is cut before its refused token, a sampled one just after it;
    with keep_shape it stays whole."""
    state = grammars.start(StructuredOutputsParams(regex="[ab]{3}"), [258])
    a, x = ord("a"), ord("x")
    tokens = torch.tensor([a, x, a])
    (det,), _ = constrain_drafts([state], [Draft(tokens)], [3], 300)
    (sam,), _ = constrain_drafts([state], [Draft(tokens, torch.full((3, 300), 1 / 300))], [3], 300)
    (whole,), (masks,) = constrain_drafts([state], [Draft(tokens)], [3], 300, keep_shape=True)
    assert det.tokens.tolist() == [a] and sam.tokens.tolist() == [a, x]
    assert sam.probs.shape == (2, 300) and whole.tokens.tolist() == [a, x, a]
    assert masks.shape[0] == 4 and not allows(masks[1], x) and allows(masks[2], x)


def _first_tokens(grammars: Grammars, draft_for, trials: int) -> torch.Tensor:
    """Run `trials` steps of draft -> constrain -> mask -> verify under the regex "[abc][abc]"
    with hand-built target logits (temperature 1); return the first emitted tokens [trials].
    `draft_for(generator)` gives each trial's Draft."""
    state = grammars.start(StructuredOutputsParams(regex="[abc][abc]"), [258])
    logits = torch.randn(2, 320, generator=torch.Generator().manual_seed(0))  # [2, V]
    logits[0, [97, 98, 99]] = torch.tensor([0.0, 0.4, 0.9])  # p0 over a, b, c after the mask
    gen = torch.Generator().manual_seed(1)
    states = [state] * trials
    drafts, masks = constrain_drafts(states, [draft_for(gen) for _ in states], [1] * trials, 320)
    width = 1 + max(int(d.tokens.numel()) for d in drafts)
    table = logits[:width].expand(trials, width, 320).contiguous()  # [N, width, V]
    mask_logits(table, masks)
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * trials, "cpu")
    p = probs_from_logits(table, st)
    tokens = torch.zeros(trials, width - 1, dtype=torch.long)
    q = torch.zeros(trials, width - 1, 320)
    for row, draft in enumerate(drafts):
        if draft.tokens.numel():
            tokens[row, 0] = draft.tokens[0]
            q[row, 0] = draft.probs[0] if draft.probs is not None else 0.0
            if draft.probs is None:
                q[row, 0, draft.tokens[0]] = 1.0
    num = torch.tensor([int(d.tokens.numel()) for d in drafts])
    _, out = verify_chain(p, tokens, q, num, [gen] * trials)
    return out[:, 0]


def _expected_first(trials: int) -> torch.Tensor:
    p = torch.zeros(320)
    p[[97, 98, 99]] = torch.tensor([0.0, 0.4, 0.9]).softmax(0)
    return p


Q_DRAFT = torch.zeros(320)
Q_DRAFT[[97, 120]] = torch.tensor([0.3, 0.7])  # "a" (allowed) 0.3, "x" (refused) 0.7


def _sampled_draft(gen: torch.Generator) -> Draft:
    token = torch.multinomial(Q_DRAFT, 1, generator=gen)
    return Draft(token, Q_DRAFT[None].clone())


def test_sampled_drafts_that_break_the_grammar_keep_the_masked_distribution(grammars) -> None:
    """A sampled drafter that proposes a refused token 70% of the time: the first emitted token
    follows the target's masked distribution (chi-square)."""
    trials = 6000
    first = _first_tokens(grammars, _sampled_draft, trials)
    counts = torch.bincount(first, minlength=320)
    assert chi2_pvalue(counts[None], _expected_first(trials)[None]) > ALPHA


def test_the_chi_square_catches_a_cut_before_a_refused_sampled_token(grammars) -> None:
    """The deliberately wrong rule, cutting a sampled draft before its refused token (then
    sampling from p instead of the residual), fails the same test."""

    def cut_before(gen: torch.Generator) -> Draft:
        draft = _sampled_draft(gen)
        return Draft(draft.tokens[:0], None) if int(draft.tokens[0]) == 120 else draft

    first = _first_tokens(grammars, cut_before, 6000)
    counts = torch.bincount(first, minlength=320)
    assert chi2_pvalue(counts[None], _expected_first(6000)[None]) < 1e-6


def test_deterministic_drafts_that_break_the_grammar_keep_the_masked_distribution(
    grammars,
) -> None:
    """A deterministic drafter proposing "x" (refused) or "b" at random: cut before "x", the
    first emitted token still follows the masked target distribution."""

    def draft(gen: torch.Generator) -> Draft:
        token = 120 if torch.rand(1, generator=gen) < 0.5 else 98
        return Draft(torch.tensor([token]))

    first = _first_tokens(grammars, draft, 6000)
    counts = torch.bincount(first, minlength=320)
    assert chi2_pvalue(counts[None], _expected_first(6000)[None]) > ALPHA


def test_mask_logits_matches_xgrammars_kernel_in_every_dtype() -> None:
    """mask_logits refuses exactly the tokens xgrammar's own kernel does (the bit order), in
    fp32 and bf16, and leaves unconstrained rows and positions beyond a mask alone."""
    import xgrammar

    logits = torch.randn(2, 3, 70, generator=torch.Generator().manual_seed(0))  # [B, T, V]
    mask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32)  # [n, W]: n 2, W 3
    reference = logits[1, :2].clone()  # [n, V]
    xgrammar.apply_token_bitmask_inplace(reference, mask, vocab_size=70)
    fast, slow = logits.clone(), logits.to(torch.bfloat16)
    mask_logits(fast, [None, mask])
    mask_logits(slow, [None, mask])
    assert torch.equal(fast[1, :2], reference) and reference.isinf().any()
    assert torch.equal(fast.isinf(), slow.isinf())
    assert not fast[0].isinf().any() and not fast[1, 2].isinf().any()  # unconstrained, beyond n
