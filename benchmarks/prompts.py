"""A small, varied set of chat prompts for plain-decoding benchmarks.

Every prompt is a conversation (a list of `{"role", "content"}` messages), rendered with the
model's own chat template by the benchmark, so both engines see exactly the same token ids.
All texts were written for this project (Apache-2.0, like the repository); none is copied from a
dataset.
"""

from __future__ import annotations

_PARAGRAPH = (
    "A hash table stores values in an array of buckets and picks the bucket of a key by "
    "hashing it. When two keys land in the same bucket, the table must resolve the collision, "
    "either by chaining entries in a small list per bucket or by probing for the next free "
    "slot. Lookups stay fast on average as long as the table is not too full, so most "
    "implementations grow the array and rehash every entry once the load factor passes a "
    "threshold. Growing costs time proportional to the number of entries, but because the "
    "array doubles each time, the cost spread over all insertions is constant per insertion. "
    "Python's dict uses open addressing with a perturbed probe sequence and keeps insertion "
    "order in a separate compact array, which also saves memory."
)

# (name, messages): a code request, a chat question, a summarization request, a math question.
PROMPTS: list[tuple[str, list[dict[str, str]]]] = [
    (
        "code",
        [
            {
                "role": "user",
                "content": "Write a Python function `merge_intervals(intervals)` that merges "
                "overlapping closed intervals given as a list of (start, end) tuples and "
                "returns them sorted. Include a docstring and two doctest examples.",
            }
        ],
    ),
    (
        "chat",
        [
            {
                "role": "system",
                "content": "You are a helpful assistant who answers briefly and concretely.",
            },
            {
                "role": "user",
                "content": "I want to start running but I get bored quickly. What are three "
                "practical ways to make the first month of running more enjoyable?",
            },
        ],
    ),
    (
        "summarize",
        [
            {
                "role": "user",
                "content": "Summarize the following paragraph in two sentences.\n\n" + _PARAGRAPH,
            }
        ],
    ),
    (
        "math",
        [
            {
                "role": "user",
                "content": "A train leaves at 9:40 and travels 210 km at an average speed of "
                "84 km/h. At what time does it arrive? Explain the steps.",
            }
        ],
    ),
]


def chat_prompts(count: int) -> list[tuple[str, list[dict[str, str]]]]:
    """The first `count` prompts (cycling through the set if `count` exceeds its size)."""
    if count <= 0:
        raise ValueError(f"the prompt count must be positive, got {count}")
    return [PROMPTS[i % len(PROMPTS)] for i in range(count)]
