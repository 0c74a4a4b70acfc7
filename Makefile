# The two commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv when it is missing and install what they need first.

VENV   ?= .venv
PY     := $(VENV)/bin/python
AKO    := $(VENV)/bin/ako
STAMP  := $(VENV)/.ako-installed
# A CPU build of torch: plain `pip install torch` would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
FASHION_MNIST := /usr/share/datasets/fashion-mnist

.PHONY: demo test data benchmarks

demo: $(STAMP) data
	@if $(AKO) info | grep '^data set fashion-mnist: /' >/dev/null; then \
	  $(AKO) train --strategy ako --workers 4 --dataset fashion-mnist --epochs 2; \
	else \
	  echo "ako: Fashion-MNIST not found (Debian package dataset-fashion-mnist); the demo trains on scikit-learn's bundled digits instead"; \
	  $(AKO) train --strategy ako --workers 4 --dataset digits --epochs 10; \
	fi

# Two test processes at once (pytest-xdist): many tests wait on timeouts and process starts.
test: $(STAMP) data
	$(PY) -m pytest -q -n 2

benchmarks: $(STAMP) data
	$(PY) benchmarks/ddp_vs_allreduce.py
	$(PY) benchmarks/main_job.py
	$(PY) benchmarks/stragglers.py
	$(PY) benchmarks/soak.py

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

# Debian's Fashion-MNIST, when apt and root are at hand; without it the demo falls back to digits.
data:
	@if [ ! -d $(FASHION_MNIST) ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Debian's dataset-fashion-mnist"; \
	  apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null; } || \
	  echo "ako: could not install dataset-fashion-mnist"; \
	fi
