"""Cross-tokenizer draft model: lossless greedy output with a draft of another vocabulary,
full acceptance of the target relabeled into another vocabulary, valid proposals, seeded
sampling, refused configs, released state; the real SmolLM2 drafting for Qwen2.5-Coder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import tokenizers
import torch
from conftest import TINY_VOCAB, build_tiny_model
from safetensors.torch import load_file, save_file
from spec_cases import GREEDY, PROMPTS, assert_fully_accepted, budgets
from tiny_tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, byte_alphabet
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from specdecode.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdecode.drafters.registry import parse_speculative_config
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.loading import load_model
from specdecode.model.registry import is_pulled
from specdecode.model.tokenizer import Tokenizer
from specdecode.sampling_params import SamplingParams
from specdecode.types import TargetFeatures

# Byte-level merges of the draft tokenizer (its tokens differ from the target's, not only ids).
MERGES = ("Ġ t", "h e", "i n", "e r", "Ġ a", "o n", "r e", "a t", "Ġt he")


def write_tokenizer(
    path: Path,
    *,
    ascii_only: bool = False,
    merges: Sequence[str] = (),
    reverse: bool = False,
    vocab_size: int = TINY_VOCAB,
) -> Tokenizer:
    """Write a byte-level BPE tokenizer folder at `path` and load it back: the byte tokens (all
    256, or with `ascii_only` tab, newline and printable ASCII), the tokens of `merges` ('a b',
    byte-level spelling), the tiny tokenizer's special tokens (`<|im_end|>` = eos), then
    `<|reserved_N|>` fillers up to `vocab_size`; ids in that order, or reversed.

    Without merges and `reverse`, all 256 bytes give `tiny_tokenizer.make_byte_tokenizer`'s ids.
    """
    spell = byte_alphabet()
    alphabet = [9, 10, *range(32, 127)] if ascii_only else list(range(256))
    pairs = [tuple(merge.split(" ")) for merge in merges]
    tokens = [spell[b] for b in alphabet] + [a + b for a, b in pairs] + list(SPECIAL_TOKENS)
    fillers = [f"<|reserved_{i}|>" for i in range(len(tokens), vocab_size)]
    ids = range(vocab_size)[::-1] if reverse else range(vocab_size)
    vocab = dict(zip(tokens + fillers, ids, strict=True))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in fillers])
    endoftext, _, im_end = (vocab[t] for t in SPECIAL_TOKENS)
    tokenizer = Tokenizer(
        backend,
        bos_token_id=endoftext,
        eos_token_ids=[im_end],
        pad_token_id=endoftext,
        chat_template=CHATML_TEMPLATE,
    )
    tokenizer.save(path)
    return Tokenizer.from_folder(path)


def build_tiny_cross_draft(model_dir: Path, out: Path, seed: int = 1) -> Path:
    """Save (once) a tiny random draft model of `model_dir`'s architecture whose tokenizer is
    not the tiny byte tokenizer: other tokens (`MERGES`), ids reversed."""
    if (out / "config.json").is_file():
        return out
    arch = json.loads((model_dir / "config.json").read_text())["model_type"]
    build_tiny_model(out, arch, seed=seed)
    write_tokenizer(out, merges=MERGES, reverse=True)
    return out


def copy_weights(model_dir: Path, out: Path, reverse: bool) -> None:
    """Copy `model_dir`'s model into `out`, its token rows (embeddings, output head) in
    reversed id order if `reverse` (the same model for a tokenizer with reversed ids)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    weights = load_file(model_dir / "model.safetensors")
    if reverse:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                weights[name] = weights[name].flip(0).contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def cross_draft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_cross_draft(tiny_model_dir, tmp_path_factory.mktemp("cross_draft"))


@pytest.fixture(scope="module")
def ascii_pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft): the tiny model with an ASCII tokenizer (every text it writes is valid
    and re-encodes to its own tokens), and the same model relabeled to the reversed ids."""
    target = tmp_path_factory.mktemp("ascii_target")
    copy_weights(tiny_model_dir, target, reverse=False)
    write_tokenizer(target, ascii_only=True)
    draft = tmp_path_factory.mktemp("ascii_relabeled")
    copy_weights(tiny_model_dir, draft, reverse=True)
    write_tokenizer(draft, ascii_only=True, reverse=True)
    return target, draft


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    plain = LLM(model=str(tiny_model_dir), dtype="float32")
    return [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]


def _config(draft: str, k: int) -> dict[str, object]:
    return {"method": "cross_tokenizer", "model": draft, "num_speculative_tokens": k}


def _cross(target_dir: Path, draft_dir: Path, k: int) -> LLM:
    return LLM(
        model=str(target_dir), dtype="float32", speculative_config=_config(str(draft_dir), k)
    )


@dataclass
class FakeSeq:
    """A `SeqView` of fixed tokens."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams = GREEDY
    generator: torch.Generator | None = None
    features: TargetFeatures | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


def _drafter(target_dir: Path, draft_dir: Path, k: int) -> CrossTokenizerDrafter:
    model = load_model(draft_dir, dtype="float32")
    draft_tok, target_tok = Tokenizer.from_folder(draft_dir), Tokenizer.from_folder(target_dir)
    return CrossTokenizerDrafter(model, draft_tok, target_tok, k)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_batched_and_alone(
    tiny_model_dir: Path, cross_draft_dir: Path, expected: list[list[int]], k: int
) -> None:
    llm = _cross(tiny_model_dir, cross_draft_dir, k)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == expected
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert list(llm.generate(prompt, GREEDY)[0].token_ids) == want
    assert llm.spec_metrics.num_draft_tokens > 0  # it really drafted
    assert not llm.engine.drafter._states  # finished sequences released their caches


@pytest.mark.parametrize("k", [1, 4])
def test_target_relabeled_into_another_vocabulary_is_fully_accepted(
    ascii_pair: tuple[Path, Path], k: int
) -> None:
    """The draft is the target with reversed ids: text bridging loses nothing, so the drafts
    are the target's own greedy tokens, K of them per step (the (K+1)-th is drafted and
    dropped: it might be incomplete)."""
    target, draft = ascii_pair
    plain = LLM(model=str(target), dtype="float32")
    want = [list(o.token_ids) for o in plain.generate(PROMPTS, GREEDY)]
    llm = _cross(target, draft, k)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [list(o.token_ids) for o in outs] == want
    assert_fully_accepted(outs, k)


def test_proposals_are_valid_target_tokens(tiny_model_dir: Path, cross_draft_dir: Path) -> None:
    k = 5
    drafter = _drafter(tiny_model_dir, cross_draft_dir, k)
    eos = set(Tokenizer.from_folder(tiny_model_dir).eos_token_ids)
    gen = torch.Generator().manual_seed(0)
    histories = [p["prompt_token_ids"] for p in PROMPTS]
    histories += [torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist() for n in (3, 20, 60)]
    seqs = [FakeSeq(f"r{i}", list(ids)) for i, ids in enumerate(histories)]
    limits = [0, 1, 2, 5, 8, 3, 100][: len(seqs)]
    drafts = drafter.propose(seqs, budgets(limits))
    assert sum(len(d.tokens) for d in drafts) > 0
    for draft, limit in zip(drafts, limits, strict=True):
        tokens = draft.tokens.tolist()
        assert draft.probs is None and draft.tree is None and draft.tokens.dtype == torch.long
        assert len(tokens) <= min(k, limit)
        assert all(0 <= t < TINY_VOCAB and t not in eos for t in tokens)
    # the same history drafts the same tokens, cached or not
    again = drafter.propose(seqs, budgets(limits))
    assert [d.tokens.tolist() for d in again] == [d.tokens.tolist() for d in drafts]


def test_relabeled_draft_proposes_the_target_continuation(ascii_pair: tuple[Path, Path]) -> None:
    target, draft = ascii_pair
    plain = LLM(model=str(target), dtype="float32")
    prompt = PROMPTS[1]["prompt_token_ids"]
    (out,) = plain.generate({"prompt_token_ids": prompt}, GREEDY)
    eos = Tokenizer.from_folder(target).eos_token_ids
    drafter = _drafter(target, draft, 4)
    history = list(prompt)
    for step in range(3):  # later steps reuse the cache
        (proposal,) = drafter.propose([FakeSeq("r", history)], budgets([4]))
        done = len(history) - len(prompt)
        want = list(out.token_ids[done : done + 4])
        want = want[: min([want.index(t) for t in eos if t in want], default=4)]
        assert proposal.tokens.tolist() == want, step
        history += list(out.token_ids[done : done + 3])


def test_long_context_drafts_nothing_beyond_the_draft_models_context(
    tiny_model_dir: Path, cross_draft_dir: Path
) -> None:
    drafter = _drafter(tiny_model_dir, cross_draft_dir, 8)
    limit = drafter.model.config.max_position_embeddings
    text = Tokenizer.from_folder(tiny_model_dir).encode("hello world " * 40)
    for n in (limit - 20, limit - 2, limit + 30):
        (draft,) = drafter.propose([FakeSeq(f"n{n}", text[:n])], budgets([8]))
        assert len(draft.tokens) <= 8
        state = drafter._states.get(f"n{n}")
        assert state is None or len(state.fed) <= limit


def test_seeded_sampling_is_reproducible(tiny_model_dir: Path, cross_draft_dir: Path) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=3, ignore_eos=True)
    llm = _cross(tiny_model_dir, cross_draft_dir, 4)
    first = [list(o.token_ids) for o in llm.generate(PROMPTS, params)]
    second = [list(o.token_ids) for o in llm.generate(PROMPTS, params)]
    fresh = _cross(tiny_model_dir, cross_draft_dir, 4)
    assert first == second == [list(o.token_ids) for o in fresh.generate(PROMPTS, params)]
    assert all(len(tokens) == 30 for tokens in first)


def test_release_forgets_the_sequence(tiny_model_dir: Path, cross_draft_dir: Path) -> None:
    drafter = _drafter(tiny_model_dir, cross_draft_dir, 3)
    drafter.propose([FakeSeq("a", [72, 101, 108, 108, 111])], budgets([3]))
    assert set(drafter._states) == {"a"}
    drafter.release("never-seen")  # ignored
    drafter.release("a")
    assert not drafter._states


def test_same_vocabulary_is_refused(tiny_model_dir: Path) -> None:
    message = r"has the target's vocabulary.*" + '"method": "draft_model"'
    with pytest.raises(UserError, match=message):
        _cross(tiny_model_dir, tiny_model_dir, 3)


def test_draft_model_with_another_tokenizer_points_to_cross_tokenizer(
    tiny_model_dir: Path, cross_draft_dir: Path
) -> None:
    config = {"model": str(cross_draft_dir), "num_speculative_tokens": 3}
    with pytest.raises(UserError, match=r'different vocabulary.*"method": "cross_tokenizer"'):
        LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=config)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tree_width": 3}, "drafts a chain: tree_width must be 1, got 3"),
        ({"tree_width": 1, "tree_depth": 2}, "tree_depth applies to trees"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an int in 1\.\.64"),
    ],
)
def test_bad_configs_are_refused(extra: dict[str, object], message: str) -> None:
    config = {"method": "cross_tokenizer", "model": "some-draft", "num_speculative_tokens": 4}
    with pytest.raises(UserError, match=message):
        parse_speculative_config({**config, **extra})


REAL_TARGET, REAL_DRAFT = "qwen2.5-coder-1.5b", "smollm2-135m"


@pytest.mark.real_model
@pytest.mark.skipif(
    not (is_pulled(REAL_TARGET) and is_pulled(REAL_DRAFT)),
    reason=f"needs the pulled {REAL_TARGET} and {REAL_DRAFT} (`specdecode pull`)",
)
@pytest.mark.slow
def test_smollm2_drafting_for_qwen_is_lossless_and_accepted() -> None:
    """The real pair (49,152 vs 151,936 tokens), int8: greedy output equals plain decoding on
    a chat prompt and a code prompt, and some drafts are accepted."""
    llm = LLM(model=REAL_TARGET, dtype="float32", quantization="int8")
    spec = llm.with_speculative_config(_config(REAL_DRAFT, 4))
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}]
    )
    prompts = [chat, "def fibonacci(n):\n    "]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert spec.spec_metrics.acceptance_rate > 0
