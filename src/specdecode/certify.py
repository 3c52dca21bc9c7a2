"""`specdecode certify`: check that speculative sampling emits the target's own distribution.

Method: run the prompt `num_samples` times for `num_tokens` tokens with the LLM's drafter (run i
with seed + i), count the token sequences, and run one chi-square test (p-value: the survival
function Q(df / 2, stat / 2), `torch.special.gammaincc` in float64; PASS when >= alpha):
- **exact** goodness of fit: a sequence's target probability is the product of p at each of
  its tokens, p from the target's logits through `probs_from_logits` (the verifier's path),
  computed as the engine does (the prompt prefilled once, each prefix in one DECODE pass).
  Only prefixes of probability >= 5 / num_samples are expanded (<= 4000 per length at 20 000
  samples, whatever the vocabulary). A run whose tokens have probability 0 fails at once.
- **two-sample** homogeneity, when a length would need more than MAX_OUTCOMES prefixes (more
  than ~20 000 samples): as many runs of plain decoding on the same weights (seeds
  seed + num_samples + i) in a 2 x bins table.
Bins: a sequence expecting fewer than 5 runs (two-sample: seen fewer than 10 times in both
samples) counts under its prefix one token shorter ("this prefix, then anything rare"), and so
on up; an empty-prefix bin still below 5 joins the smallest bin.

Why it is exact: lossless speculation emits each run distributed exactly as the target's own
sampling, so the counts are multinomial with the enumerated probabilities (or both samples
share one law), and with >= 5 expected runs per bin Pearson's statistic follows chi-square
with bins - 1 degrees of freedom: a correct drafter fails with probability alpha.

Power (~90% at alpha 0.01): a bias whose divergence sum (p'_i - p_i)^2 / p_i over the bins
exceeds about 15 / n (1 degree of freedom), 25 / n (5) or 65 / n (100). At n = 20 000: 1.4
points of probability moved between two outcomes of 0.5 (2.9 points over 100 bins), or 0.8
points into an outcome of 0.1. The two-sample test needs twice the divergence.

Limits: the first few tokens after one prompt only (a drafter that errs later or on other
prompts may pass); sampling only (greedy: `specdecode generate --compare`); biases below the
power pass; a correct drafter fails at one seed in 1 / alpha. A drafter that proposes nothing
for the prompt checks nothing (refused).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import is_positive_int
from specdecode.drafters.plain import PlainDrafter
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.metrics import SpecCounters
from specdecode.model.transformer import Transformer
from specdecode.sampling.probs import SamplingTensors, probs_from_logits
from specdecode.sampling_params import SamplingParams

DEFAULT_PROMPT = "The weather today is"
MIN_EXPECTED = 5.0  # every chi-square bin expects at least this many runs (smaller: merged)
MAX_OUTCOMES = 4096  # the exact test enumerates at most this many prefixes of one length
CHUNK_ROWS = 64  # prefixes per target pass while enumerating

Outcome = tuple[int, ...]  # the token ids of one run (or a prefix of them)
Cell = tuple[float, float]  # one bin's counts: (runs, expected runs) or (runs, reference runs)


@dataclass(frozen=True, slots=True)
class CertifyConfig:
    """What `certify` samples and how it decides.

    prompt: text, or its token ids.
    num_tokens: tokens per run (1..16). The first token comes from the prefill and a draft never
        covers a run's last token, so 3 is the fewest that check a draft token.
    num_samples: speculative runs (the two-sample test adds as many plain ones).
    temperature (> 0), top_k, top_p: the sampling parameters checked.
    alpha: significance level in (0, 1): FAIL when the p-value is below it.
    seed: run i uses seed + i (plain runs of the two-sample test: seed + num_samples + i).
    batch_size: runs per engine batch.
    """

    prompt: str | tuple[int, ...] = DEFAULT_PROMPT
    num_tokens: int = 3
    num_samples: int = 20_000
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    alpha: float = 0.01
    seed: int = 0
    batch_size: int = 1000

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list | tuple):
            object.__setattr__(self, "prompt", tuple(self.prompt))
        ids = isinstance(self.prompt, tuple) and all(isinstance(t, int) for t in self.prompt)
        if not self.prompt or not (isinstance(self.prompt, str) or ids):
            raise UserError(f"prompt must be non-empty text or token ids, got {self.prompt!r}")
        if not is_positive_int(self.num_tokens) or self.num_tokens > 16:
            raise UserError(f"num_tokens must be an int in 1..16, got {self.num_tokens!r}")
        for name in ("num_samples", "batch_size"):
            if not is_positive_int(getattr(self, name)):
                raise UserError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not self.temperature > 0:
            raise UserError(
                f"temperature must be > 0, got {self.temperature}: certify checks sampling "
                "(greedy speculation is checked token for token by `generate --compare`)"
            )
        if not 0 < self.alpha < 1:
            raise UserError(f"alpha must be in (0, 1), e.g. 0.01, got {self.alpha}")
        self.params(self.seed)  # SamplingParams checks top_k, top_p and the seed

    def params(self, seed: int) -> SamplingParams:
        """The sampling parameters of the run with `seed`."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            max_tokens=self.num_tokens,
            seed=seed,
            ignore_eos=True,
        )


@dataclass(frozen=True, slots=True)
class CertifyResult:
    """The verdict of `certify` and what it rests on.

    test: "exact" (goodness of fit) or "two-sample" (homogeneity with plain decoding's runs).
    statistic: Pearson's, with degrees_of_freedom = num_bins - 1 (bins: sequences, and groups
        of rare ones under a prefix). p_value: the chance of a statistic this large if
        speculation is lossless; 0 when num_impossible runs emitted target probability 0.
    num_draft_tokens, acceptance_rate: what the drafter proposed and the verifier kept.
    """

    test: str
    statistic: float
    degrees_of_freedom: int
    p_value: float
    alpha: float
    num_samples: int
    num_bins: int
    num_draft_tokens: int
    acceptance_rate: float
    num_impossible: int = 0

    @property
    def passed(self) -> bool:
        """No evidence against losslessness: p-value >= alpha and no impossible sequence."""
        return self.num_impossible == 0 and self.p_value >= self.alpha

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def certify(llm: LLM, config: CertifyConfig, progress: bool = False) -> CertifyResult:
    """Sample `config.num_samples` runs with `llm`'s drafter and test them against the target;
    with `progress`, a bar on stderr counts the runs drawn (and the drafter's acceptance).

    Raises UserError for a plain LLM, a prompt that leaves no room for the runs, or a drafter
    that proposed nothing (nothing speculative would be checked).
    """
    if isinstance(llm.engine.drafter, PlainDrafter):
        raise UserError(
            "certify needs a speculative LLM (a speculative_config or a drafter): plain "
            "decoding is the reference it is checked against"
        )
    ids = _prompt_ids(llm, config)
    observed, spec = _sample(llm, ids, config, config.seed, progress)
    if spec.num_draft_tokens == 0:
        raise UserError(
            f"the drafter proposed no token in {config.num_samples} runs of {config.num_tokens} "
            "tokens, so nothing speculative was checked: use a prompt it drafts on (ngram: one "
            "that repeats itself) or more tokens per run"
        )
    enumeration = _Enumeration(llm.model, ids, config, observed)
    cells = enumeration.run()
    if cells is not None:
        table = _table(cells, lambda cell: cell[1], config.num_tokens)  # [2, C]: runs, expected
        statistic = _pearson(table[0], table[1] / table[1].sum() * table[0].sum())
    else:
        plain = llm.with_speculative_config(None)
        reference, _ = _sample(plain, ids, config, config.seed + config.num_samples, progress)
        both = {s: (observed[s], reference[s]) for s in observed.keys() | reference.keys()}
        table = _table(both, lambda cell: (cell[0] + cell[1]) / 2, config.num_tokens)  # [2, C]
        statistic = _pearson(table, table.sum(1, keepdim=True) * table.sum(0) / table.sum())
    bins, impossible = table.shape[1], enumeration.impossible
    return CertifyResult(
        test="two-sample" if cells is None else "exact",
        statistic=statistic,
        degrees_of_freedom=bins - 1,
        p_value=0.0 if impossible else _survival(statistic, bins - 1),
        alpha=config.alpha,
        num_samples=config.num_samples,
        num_bins=bins,
        num_draft_tokens=spec.num_draft_tokens,
        acceptance_rate=spec.acceptance_rate,
        num_impossible=impossible,
    )


def _prompt_ids(llm: LLM, config: CertifyConfig) -> list[int]:
    """The prompt's token ids; refuses a prompt that leaves no room for num_tokens more."""
    prompt = config.prompt
    ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    context = llm.model.config.max_position_embeddings
    if len(ids) + config.num_tokens > context:
        raise UserError(
            f"the prompt has {len(ids)} tokens: with {config.num_tokens} tokens per run it "
            f"does not fit the model's context of {context} tokens"
        )
    return ids


def _sample(
    llm: LLM,
    prompt_ids: list[int],
    config: CertifyConfig,
    first_seed: int,
    progress: bool = False,
) -> tuple[Counter[Outcome], SpecCounters]:
    """Run the prompt num_samples times (run i with seed first_seed + i, batch_size runs per
    batch); returns how often each sequence came out and the runs' counters added up. With
    `progress`, a bar on stderr counts the runs (and shows the acceptance so far)."""
    prompt = {"prompt_token_ids": prompt_ids}
    counts: Counter[Outcome] = Counter()
    spec = SpecCounters()
    what = "plain runs" if isinstance(llm.engine.drafter, PlainDrafter) else "speculative runs"
    bar = tqdm(total=config.num_samples, desc=f"certify: {what}", unit="run", disable=not progress)
    for start in range(0, config.num_samples, config.batch_size):
        end = min(start + config.batch_size, config.num_samples)
        params = [config.params(first_seed + i) for i in range(start, end)]
        for out in llm.generate_as_finished([prompt] * len(params), params):
            counts[out.token_ids] += 1
            assert out.metrics is not None
            spec += out.metrics.spec
            bar.update()
        if spec.num_draft_tokens:
            bar.set_postfix(drafted=spec.num_draft_tokens, acceptance=f"{spec.acceptance_rate:.2f}")
    bar.close()
    return counts, spec


class _Enumeration:
    """The target's probability of each sequence that may fill a bin, with the runs binned.

    `run()` returns the cells: a sequence of probability >= MIN_EXPECTED / num_samples, or a
    shorter prefix standing for "this prefix, then a token not enumerated" -> (runs, expected
    runs); `impossible` counts the runs with a token of target probability 0.
    Example, 20 000 runs of 2 tokens: p(a) = .7, p(b) = .3 - 1e-6, p(c) = 1e-6, and a always
    follows: cells (a, a) expecting 14 000 runs, (b, a) ~6 000, (a,) and (b,) 0, and () 0.02
    holding the runs that began with c (its probability is below 5 / 20 000: not expanded).
    """

    def __init__(
        self, model: Transformer, prompt_ids: list[int], config: CertifyConfig, observed: Counter
    ) -> None:
        self.model, self.config, self.prompt_ids = model, config, prompt_ids
        self.runs = dict(observed)  # runs whose tokens so far are an enumerated prefix
        self.cells: dict[Outcome, Cell] = {}
        self.impossible = 0

    @torch.inference_mode()
    def run(self) -> dict[Outcome, Cell] | None:
        """The cells, or None when one length has more than MAX_OUTCOMES prefixes to expand."""
        first, cache = _prefill(self.model, self.prompt_ids, self.config.num_tokens)
        nodes: dict[Outcome, float] = {(): 1.0}  # enumerated prefixes -> target probability
        for depth in range(self.config.num_tokens):
            waiting: dict[Outcome, list[Outcome]] = {}  # enumerated prefix -> its runs
            for run in self.runs:
                waiting.setdefault(run[:depth], []).append(run)
            prefixes, children = list(nodes), {}
            for start in range(0, len(prefixes), CHUNK_ROWS):
                chunk = prefixes[start : start + CHUNK_ROWS]
                logits = first if depth == 0 else _decode_logits(self.model, cache, chunk)
                children.update(self._expand(chunk, [nodes[p] for p in chunk], logits, waiting))
                if len(children) > MAX_OUTCOMES:
                    return None
            nodes = children
        n = self.config.num_samples
        self.cells.update((s, (self.runs.get(s, 0), n * prob)) for s, prob in nodes.items())
        return self.cells

    def _expand(
        self,
        chunk: list[Outcome],
        prior: list[float],
        logits: Tensor,
        waiting: dict[Outcome, list[Outcome]],
    ) -> dict[Outcome, float]:
        """The enumerated children of `chunk`'s prefixes (of probabilities `prior`, with
        next-token logits [c, V]) -> probability; fills each prefix's "then a token not
        enumerated" cell with the runs that go there."""
        st = SamplingTensors.from_params([self.config.params(0)] * len(chunk), self.model.device)
        joint = torch.tensor(prior, dtype=torch.float64)[:, None] * (
            probs_from_logits(logits, st).double().cpu()
        )  # [c, V]
        keep = joint >= MIN_EXPECTED / self.config.num_samples  # [c, V]
        arriving = [(row, run) for row, p in enumerate(chunk) for run in waiting.get(p, ())]
        rows = torch.tensor([row for row, _ in arriving], dtype=torch.long)
        tokens = torch.tensor([run[len(chunk[0])] for _, run in arriving], dtype=torch.long)
        leaving = [0] * len(chunk)  # per prefix: runs whose next token is not enumerated
        for (row, run), prob, kept in zip(
            arriving, joint[rows, tokens].tolist(), keep[rows, tokens].tolist(), strict=True
        ):
            if kept:
                continue
            if prob > 0:
                leaving[row] += self.runs.pop(run)
            else:
                self.impossible += self.runs.pop(run)
        rest = joint.masked_fill(keep, 0.0).sum(1).tolist()  # [c]
        n = self.config.num_samples
        self.cells.update((p, (leaving[r], n * rest[r])) for r, p in enumerate(chunk))
        rows, tokens = keep.nonzero(as_tuple=True)
        new = [chunk[r] + (t,) for r, t in zip(rows.tolist(), tokens.tolist(), strict=True)]
        return dict(zip(new, joint[rows, tokens].tolist(), strict=True))


def _prefill(model: Transformer, prompt_ids: list[int], room: int) -> tuple[Tensor, KVCache]:
    """Prefill the prompt once into a one-row cache with `room` spare slots; returns its
    next-token logits [1, V] and the cache."""
    device = model.device
    cache = model.new_cache(1, len(prompt_ids) + room)
    meta = AttentionMetadata.prefill([len(prompt_ids)], device)
    last = torch.tensor([[len(prompt_ids) - 1]], device=device)  # [1, 1]
    logits, _ = model(torch.tensor([prompt_ids], device=device), meta, cache, logits_index=last)
    return logits[:, 0], cache


def _decode_logits(model: Transformer, prompt_cache: KVCache, prefixes: list[Outcome]) -> Tensor:
    """Logits [c, V] after the prompt and each of the c prefixes (all of one length), as the
    engine's DECODE passes compute them, over copies of the prompt's cache."""
    device, length, width = model.device, prompt_cache.lengths[0], len(prefixes[0])
    cache = model.new_cache(len(prefixes), length + width)
    cache.load_prefix(prompt_cache, length)
    meta = AttentionMetadata.contiguous(
        AttentionMode.DECODE, cache.lengths, [width] * len(prefixes), device
    )
    last = torch.full((len(prefixes), 1), width - 1, device=device)  # [c, 1]
    logits, _ = model(torch.tensor(prefixes, device=device), meta, cache, logits_index=last)
    return logits[:, 0]


def _table(cells: dict[Outcome, Cell], size: Callable[[Cell], float], length: int) -> Tensor:
    """The [2, C] table of `cells` (keys: sequences or prefixes of at most `length` tokens)
    whose `size` (an expected count) is >= MIN_EXPECTED: a smaller cell is merged into its
    prefix one token shorter, longest keys first; the empty prefix, if still smaller, into
    the smallest column. `cells` is consumed. Example: (a, b) 3 and (a, c) 4 -> (a,) 7.
    """
    columns: list[Cell] = []
    for depth in range(length, 0, -1):
        for key in [k for k in cells if len(k) == depth]:
            cell = cells.pop(key)
            if size(cell) >= MIN_EXPECTED:
                columns.append(cell)
            else:
                parent = cells.get(key[:-1], (0.0, 0.0))
                cells[key[:-1]] = (parent[0] + cell[0], parent[1] + cell[1])
    root = cells.get((), (0.0, 0.0))
    if columns and size(root) < MIN_EXPECTED:
        i = min(range(len(columns)), key=lambda j: size(columns[j]))
        columns[i] = (columns[i][0] + root[0], columns[i][1] + root[1])
    elif size(root) > 0 or not columns:
        columns.append(root)
    return torch.tensor(columns, dtype=torch.float64).T


def _pearson(observed: Tensor, expected: Tensor) -> float:
    """Pearson's statistic sum (observed - expected)^2 / expected (same shapes)."""
    return float(((observed - expected) ** 2 / expected).sum())


def _survival(statistic: float, df: int) -> float:
    """P(chi-square with df degrees of freedom >= statistic) = Q(df / 2, statistic / 2);
    1 when df is 0 (one bin: nothing to compare)."""
    if df == 0:
        return 1.0
    half = torch.tensor([df / 2, statistic / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


def certify_text(result: CertifyResult, config: CertifyConfig) -> str:
    """`specdecode certify`'s report: what ran, the statistic, the verdict, what it means."""
    test = {
        "exact": "chi-square goodness of fit to the target's exact distribution",
        "two-sample": "chi-square homogeneity with as many runs of plain decoding",
    }[result.test]
    lines = [
        f"test: {test}",
        f"samples: {result.num_samples} runs of {config.num_tokens} tokens (drafted tokens "
        f"{result.num_draft_tokens}, acceptance {result.acceptance_rate:.2f})",
        f"statistic {result.statistic:.2f}, degrees of freedom {result.degrees_of_freedom}, "
        f"p-value {result.p_value:.4g}, bins {result.num_bins}",
    ]
    if result.num_impossible:
        lines.append(
            f"FAIL: {result.num_impossible} runs emitted tokens the target gives probability 0"
        )
    elif result.passed:
        lines.append(
            f"PASS: no evidence at alpha {result.alpha} that speculation changes the distribution"
        )
    else:
        lines.append(
            f"FAIL: p-value below alpha {result.alpha}: speculative runs are not distributed as "
            "the target's own sampling"
        )
    return "\n".join(lines)
