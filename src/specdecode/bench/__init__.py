"""Benchmark harness: methods and peers side by side on the same prompts, interleaved."""
