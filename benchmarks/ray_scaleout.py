"""One server vs replicas behind Ray Serve, on this machine: aggregate tokens/s of concurrent
streams, and the latency the proxy adds to a lone request.

Starts, side by side on 127.0.0.1: `specdecode serve MODEL` (one engine, all cores), and
`specdecode serve MODEL --replicas R` (R engines of cores / R threads each, behind Ray Serve's
proxy); for the latency, also `--replicas 1` (one engine with all cores, behind the proxy).
Then it alternates between them, round by round (an idle server costs nothing): a burst of
CONCURRENCY streamed chat requests (aggregate completion tokens / wall seconds of the burst),
and single requests, streamed and not (seconds to the last token).

    python benchmarks/ray_scaleout.py --model smollm2-135m --replicas 2 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a hash map is in three sentences.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "List five prime numbers and say why each is prime.",
]
START_TIMEOUT_S = 600


def launch(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", model, "--port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(base: str, model: str, server: subprocess.Popen) -> None:
    """Until a one-token completion answers (every replica may still be loading after that:
    the first rounds are a warm-up)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server on {base} exited with {server.returncode}")
        try:
            body = {"model": model, "prompt": "hi", "max_tokens": 1}
            if httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{base} did not start")


def request(base: str, model: str, prompt: str, max_tokens: int) -> int:
    """One streamed chat completion; its completion tokens."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def burst(base: str, model: str, concurrency: int, max_tokens: int) -> float:
    """Aggregate tokens/s of `concurrency` simultaneous streams."""
    counts = [0] * concurrency

    def one(i: int) -> None:
        counts[i] = request(base, model, PROMPTS[i % len(PROMPTS)], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def lone(base: str, model: str, max_tokens: int, stream: bool) -> float:
    """Seconds of one request alone, streamed or not."""
    start = time.perf_counter()
    if stream:
        request(base, model, PROMPTS[0], max_tokens)
    else:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPTS[0]}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - start


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after 1 warm-up")
    parser.add_argument("--port", type=int, default=8021, help="first of three ports")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    threads = str(max(1, cores // args.replicas))
    setups = {
        "one server": ["--max-num-seqs", str(args.concurrency)],
        f"ray x{args.replicas}": [
            "--replicas",
            str(args.replicas),
            "--threads-per-replica",
            threads,
        ],
        "ray x1": ["--replicas", "1", "--threads-per-replica", str(cores)],
    }
    servers, bases = [], {}
    try:
        for offset, (name, extra) in enumerate(setups.items()):
            base = f"http://127.0.0.1:{args.port + offset}"
            server = launch(args.model, args.port + offset, extra)
            servers.append(server)
            wait_ready(base, args.model, server)
            bases[name] = base
        rates: dict[str, list[float]] = {name: [] for name in setups}
        latency: dict[str, list[float]] = {name: [] for name in setups}
        whole: dict[str, list[float]] = {name: [] for name in setups}  # not streamed
        for round_ in range(args.rounds + 1):
            order = list(setups) if round_ % 2 else list(reversed(setups))
            for name in order:
                rate = burst(bases[name], args.model, args.concurrency, args.max_tokens)
                seconds = lone(bases[name], args.model, args.max_tokens, stream=True)
                unstreamed = lone(bases[name], args.model, args.max_tokens, stream=False)
                if round_:  # round 0 warms every replica up
                    rates[name].append(rate)
                    latency[name].append(seconds)
                    whole[name].append(unstreamed)
        one, many = "one server", f"ray x{args.replicas}"
        for name in setups:
            print(
                f"{name:12s} {args.concurrency} streams: {summary(rates[name])} tok/s; "
                f"one request alone: {summary(latency[name])} s streamed, "
                f"{summary(whole[name])} s not streamed"
            )
        gain = [a / b for a, b in zip(rates[many], rates[one], strict=True)]
        added = [a / b - 1 for a, b in zip(latency["ray x1"], latency[one], strict=True)]
        print(f"{many} / one server, aggregate tokens/s: {summary(gain)}")
        print(f"latency added by the proxy, streamed (ray x1 / one server - 1): {summary(added)}")
        added = [a / b - 1 for a, b in zip(whole["ray x1"], whole[one], strict=True)]
        print(f"latency added by the proxy, not streamed: {summary(added)}")
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(60)


if __name__ == "__main__":
    main()
