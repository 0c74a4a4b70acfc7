#!/usr/bin/env bash
# The peers' virtualenv for benchmarks/peers.py: Hivemind and torchft beside ako, with the
# torch every ako run uses. Their dependencies (protobuf, grpcio, pydantic, ...) would clash
# with ako's optional ones (tensorboard), so they live apart from .venv.
#
#   benchmarks/peers_venv.sh [DIR]      # DIR defaults to .venv-peers, relative to the repo root
#
# Idempotent: a marker file in DIR records what was installed; a second call with the same
# pins (and an unchanged pyproject.toml) does nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${1:-.venv-peers}"
PY="$VENV/bin/python"

# torch==2.13.0: on this project's machines the package index holds a CPU build, which pip
# picks; elsewhere install a CPU build first, e.g.
#   $PY -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# (plain `pip install torch` from PyPI pulls a multi-GB CUDA build).
TORCH="torch==2.13.0"
PEERS=(hivemind==1.1.12 torchft==0.2.0)
# What `import ako` needs (pyproject.toml's dependencies that ako imports at start-up);
# scikit-learn, matplotlib and tensorboard are imported lazily and are not needed here.
AKO_DEPS=("numpy>=1.26" "tqdm>=4.66" "tomli-w>=1.0" "simpy>=4.1")

MARKER="$VENV/.peers-installed"
WANT="$TORCH ${PEERS[*]} ${AKO_DEPS[*]} pyproject=$(sha256sum pyproject.toml | cut -c1-16)"
if [ -x "$PY" ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WANT" ]; then
  echo "peers venv: $VENV is ready ($TORCH ${PEERS[*]})"
  exit 0
fi

test -x "$PY" || python3 -m venv "$VENV"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "$TORCH"
# the peers next to the torch already there: pip keeps it, as it satisfies their requirements
"${PIP[@]}" "$TORCH" "${PEERS[@]}"
"${PIP[@]}" "$TORCH" "${AKO_DEPS[@]}"
"${PIP[@]}" --no-deps -e .
"$PY" - <<'EOF'
import torch, hivemind, torchft, ako  # noqa: F401 - fails here, loudly, if something is missing
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
print(f"peers venv: torch {torch.__version__}, hivemind {hivemind.__version__}, torchft ok, ako ok")
EOF
echo "$WANT" >"$MARKER"
