#!/usr/bin/env bash
# Creates .venv inside the repository with a CPython 3.9-3.11 interpreter and
# installs the pinned stack plus this package (idempotent: a second run is quick).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return 0; fi
  for cand in python3.11 python3.10 python3.9 python3 python; do
    if command -v "$cand" >/dev/null 2>&1; then
      if "$cand" -c 'import sys; sys.exit(0 if (3, 9) <= sys.version_info[:2] <= (3, 11) else 1)' 2>/dev/null; then
        command -v "$cand"; return 0
      fi
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! PY=$(find_python); then
    echo "error: actorq-jax needs CPython 3.9, 3.10 or 3.11 (dm-reverb 0.14.0 ships wheels for" >&2
    echo "those only). Install one, or point PYTHON=/path/to/python3.11 at it, and rerun." >&2
    exit 1
  fi
  echo "setup: creating .venv with $PY ($("$PY" --version 2>&1))"
  "$PY" -m venv .venv
fi

# uv downloads and unpacks the 2.3 GB stack in parallel (the same pins resolve to the same versions), in about
# 40 s where pip takes about 75 s. --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing
# would ever write the .pyc files and every process would compile TensorFlow's sources again (3x its import time).
# Pinned like every other tool; test.sh installs the benchmark extras with it too.
[ -x .venv/bin/uv ] || .venv/bin/python -m pip install --quiet "uv==0.13.8"

stamp=.venv/.actorq-installed
if [ ! -f "$stamp" ] || [ requirements.txt -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ -n "$(find actorq_jax/kernels -name '*.cc' -newer "$stamp" 2>/dev/null)" ]; then
  echo "setup: installing pinned dependencies (under a minute on a fresh machine)"
  .venv/bin/python -m uv pip install --quiet --compile-bytecode --python .venv/bin/python -r requirements.txt
  # No build isolation: setup.py compiles the int8 kernel against the installed jaxlib's headers.
  .venv/bin/python -m uv pip install --quiet --python .venv/bin/python --no-build-isolation --no-deps -e .
  touch "$stamp"
fi
