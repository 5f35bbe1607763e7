# Two commands a newcomer needs: `make serve` (main job) and `make test`.
# Each creates .venv and installs what it needs (CPU torch 2.13.0 pinned).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-slow lint bench inspect clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray,nixl,tracing]'
	$(PY) -m pip install -q --no-deps nixl==1.5.1  # the `nixl` module over nixl-cu12; see pyproject.toml
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9  # structured outputs; see pyproject.toml
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m k3serve serve --enable-auto-tool-choice --tool-call-parser kimi_k3 --reasoning-parser kimi_k3 \
		--speculative-config '{"method": "dspark", "model": "dspark", "num_speculative_tokens": 4}'

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)  # ruff's settings are in pyproject.toml; `ruff format k3serve tests bench` fixes the layout
	$(PY) -m ruff check k3serve tests bench
	$(PY) -m ruff format --check k3serve tests bench

bench: $(STAMP)
	$(PY) bench/kda_prefill.py
	$(PY) bench/generate_speed.py
	$(PY) bench/engine_concurrency.py
	$(PY) bench/prefix_cache_ttft.py
	$(PY) bench/spec_decode.py
	$(PY) bench/demo_spec.py
	$(PY) bench/moe_kernels.py
	$(PY) bench/step_profile.py --kernels torch

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
