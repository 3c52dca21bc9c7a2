"""Screenshot of the visualizer (docs/img/viz.png) on a real model, and the cost of step events.

Starts `specdecode serve MODEL` with two drafters on 127.0.0.1, drives /viz in headless Chromium
(Debian's chromium + chromium-driver, via Selenium), submits PROMPT and saves the page. Then it
measures what the page's step events cost: the same streamed requests with `step_events` on
and off, interleaved, tokens/s each (median and range over the rounds).

    python benchmarks/viz_screenshot.py --model smollm2-135m --out docs/img/viz.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

PROMPT = (
    "Rewrite this Python function with a while loop instead of the for loop, and add a "
    "docstring. Reply with the whole function only.\n\n"
    "def is_prime(n):\n    if n < 2:\n        return False\n"
    "    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n            return False\n"
    "    return True\n"
)
DRAFTERS = [
    {"method": "ngram", "num_speculative_tokens": 8},
    {"method": "suffix", "num_speculative_tokens": 16},
]
START_TIMEOUT_S = 300


def serve(model: str, port: int) -> subprocess.Popen:
    """`specdecode serve` in a child process; returns once /health answers 200."""
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", model, "--port", str(port)]
    for drafter in DRAFTERS:
        cmd += ["--speculative-config", json.dumps(drafter)]
    server = subprocess.Popen(cmd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        time.sleep(1)
    server.kill()
    raise RuntimeError("the server did not start")


def screenshot(base: str, out: Path, max_tokens: int) -> None:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1350"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(
        options=options, service=webdriver.ChromeService("/usr/bin/chromedriver")
    )
    try:
        chrome.get(f"{base}/viz")
        wait = WebDriverWait(chrome, 300)
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#drafter option"))
        chrome.find_element(By.ID, "prompt").clear()
        chrome.find_element(By.ID, "prompt").send_keys(PROMPT)
        box = chrome.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys(str(max_tokens))
        chrome.find_element(By.ID, "run").click()
        wait.until(
            lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-done") == "true"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(chrome.get_screenshot_as_png())
        print(f"saved {out}; {chrome.find_element(By.ID, 'speedup').text}")
    finally:
        chrome.quit()


def tokens_per_s(base: str, model: str, events: bool, max_tokens: int) -> float:
    """One streamed chat request; completion tokens / wall seconds as the client sees them."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "step_events": events,
    }
    start, tokens = time.perf_counter(), 0
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--out", type=Path, default=Path("docs/img/viz.png"))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=8, help="events on/off pairs to time")
    args = parser.parse_args()
    server = serve(args.model, args.port)
    base = f"http://127.0.0.1:{args.port}"
    try:
        screenshot(base, args.out, args.max_tokens)
        if not args.rounds:
            return
        rates: dict[bool, list[float]] = {True: [], False: []}
        for round_ in range(args.rounds):
            for events in (True, False) if round_ % 2 else (False, True):
                rates[events].append(tokens_per_s(base, args.model, events, args.max_tokens))
        ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
        for events, values in rates.items():
            print(
                f"step_events {'on ' if events else 'off'}: {statistics.median(values):.2f} tok/s "
                f"({min(values):.2f}-{max(values):.2f})"
            )
        print(
            f"on / off: median {statistics.median(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}) over {len(ratios)} pairs"
        )
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
