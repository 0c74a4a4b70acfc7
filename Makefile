# The two commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv when it is missing and install what they need first.

VENV   ?= .venv
PY     := $(VENV)/bin/python
AKO    := $(VENV)/bin/ako
STAMP  := $(VENV)/.ako-installed
# A CPU build of torch: plain `pip install torch` would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
FASHION_MNIST := /usr/share/datasets/fashion-mnist
FORTUNES      := /usr/share/games/fortunes
# The language model's recipe (docs/training.md, "Language models"): AdamW, warm-up, cosine.
LM_FLAGS := --dataset fortunes --model gpt --batch-size 16 --optimizer adamw --lr 3e-3 --warmup 20 --lr-schedule cosine

.PHONY: demo demo-lm test data benchmarks

demo: $(STAMP) data
	@if $(AKO) info | grep '^data set fashion-mnist: /' >/dev/null; then \
	  $(AKO) train --strategy ako --workers 4 --dataset fashion-mnist --epochs 2; \
	else \
	  echo "ako: Fashion-MNIST not found (Debian package dataset-fashion-mnist); the demo trains on scikit-learn's bundled digits instead"; \
	  $(AKO) train --strategy ako --workers 4 --dataset digits --epochs 10; \
	fi

# The language-model job: Ako on 4 workers, the GPT on Debian's fortunes, then a sample of its text.
demo-lm: $(STAMP) data
	@test -d $(FORTUNES) || { echo "ako: $(FORTUNES) not found: install Debian's fortunes (apt-get install fortunes)"; exit 2; }
	$(AKO) train --strategy ako --workers 4 $(LM_FLAGS) --epochs 1 --eval-every 0.25 --out-dir runs/lm
	$(AKO) generate "$$(ls -d runs/lm/*-ako | tail -1)" --prompt "The " --tokens 300

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

# Debian's Fashion-MNIST and fortunes (text), when apt and root are at hand; without
# Fashion-MNIST the demo falls back to digits.
data:
	@for pair in dataset-fashion-mnist:$(FASHION_MNIST) fortunes:$(FORTUNES); do \
	  pkg=$${pair%%:*}; dir=$${pair#*:}; \
	  if [ ! -d $$dir ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's $$pkg"; \
	    apt-get install -y -qq $$pkg >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $$pkg >/dev/null; } || \
	    echo "ako: could not install $$pkg"; \
	  fi; \
	done
