"""The target's passes a training batch needs: read from the feature store, or run and stored.

An encoded example is (stream index, token ids, prompt length). Under responses "dataset" the
ids are the whole sequence; under "target" the target first answers the prompts it has not
answered before (greedy, batched: `llm.generate`), and the store keeps its answers with the
states, so a second epoch, a resumed run or a later run reads them instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.train.feature_store import FeatureStore
from specdecode.train.target_pass import TargetPass, run_targets

Encoded = tuple[int, list[int], int]  # (stream index, token ids, prompt length)


class PassSource:
    """Passes over encoded examples, from `store` where it has them, else from `llm`'s target.

    Args:
        llm: the target (its passes; its answers under responses "target").
        store: where passes are kept (its key's layers are the ones run).
        responses: "dataset" (the ids are the sequences) or "target" (the target answers each
            prompt greedily, up to max_answer_tokens, the sequence cut to max_length).
        rows: sequences one target pass may run together (`target_pass.run_targets`).
    """

    def __init__(
        self,
        llm: LLM,
        store: FeatureStore,
        responses: str,
        max_answer_tokens: int,
        max_length: int,
        rows: int = 1,
    ) -> None:
        self.llm = llm
        self.store = store
        self.layers = tuple(store.key["layers"])  # type: ignore[arg-type]
        self.responses = responses
        self.max_answer_tokens = max_answer_tokens
        self.max_length = max_length
        self.rows = rows
        self.computed = 0  # passes this source ran (not read)

    def passes(self, batch: Sequence[Encoded]) -> list[TargetPass]:
        """The passes of `batch`, in its order; those the store lacked are run and stored."""
        missing = [item for item in batch if item[0] not in self.store]
        if self.responses == "target":
            missing = self._answered(missing)
        sequences = [(ids, n) for _, ids, n in missing]
        passes = run_targets(self.llm.model, sequences, self.layers, self.rows)
        ran = {index: p for (index, _, _), p in zip(missing, passes, strict=True)}
        self.computed += len(ran)
        for index, p in ran.items():
            self.store.put(index, p)
        out = []
        for index, ids, n in batch:
            p = ran[index] if index in ran else self.store.get(index)
            if p.prompt_length != n or p.tokens[:n].tolist() != ids[:n]:
                raise UserError(
                    f"feature store {self.store.root} holds another example at stream index "
                    f"{index} (other data or another tokenizer); give another --features folder"
                )
            out.append(p)
        return out

    def _answered(self, batch: list[Encoded]) -> list[Encoded]:
        """The batch's prompts answered by the target itself (greedy, one batched call)."""
        if not batch:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=self.max_answer_tokens)
        outs = self.llm.generate([{"prompt_token_ids": ids[:n]} for _, ids, n in batch], params)
        return [
            (index, (ids[:n] + list(out.token_ids))[: self.max_length], n)
            for (index, ids, n), out in zip(batch, outs, strict=True)
        ]
