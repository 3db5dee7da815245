# Two set-up commands a fresh machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned: on CPU machines 2.13.0 resolves to a local CPU wheel; an unpinned
# torch pulls gigabytes of CUDA packages.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-gpu serve clean

# --no-cache-dir: the environment is ~3 GB; a wheel cache beside it would nearly double what a
# fresh machine needs on disk (a CI run once failed with "No space left on device" here).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-cache-dir --upgrade pip
	$(PY) -m pip install -q --no-cache-dir "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-cache-dir -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# Timing tests run alone after the rest: beside a second pytest worker on a 2-core machine their
# measurements swing by 30-70% (tests/model/test_predict_cpu.py failed that way in CI). So do the
# `serial` ones, which must not share the machine with another test process (the marker says why).
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n 2 --timeout 600 --durations=20 -m "not timing and not serial"
	TRITON_INTERPRET=1 $(PY) -m pytest -q --timeout 600 -m "timing or serial"

# On a CUDA machine: compiled (not interpreted) Triton, and only the GPU-marked tests.
test-gpu: $(VENV)/.installed
	TRITON_INTERPRET=0 $(PY) -m pytest -q -m gpu tests/gpu

serve: $(VENV)/.installed
	$(VENV)/bin/stoker serve

clean:
	rm -rf $(VENV) .pytest_cache
