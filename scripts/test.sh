#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Benchmark peers (ONNX Runtime) for the peers.py smoke test; reinstalled only when the file changes.
[ .venv/.actorq-bench-installed -nt requirements-bench.txt ] || { .venv/bin/python -m pip install --quiet -r requirements-bench.txt && touch .venv/.actorq-bench-installed; }
# CI's machine has a compiler: a kernel that did not build fails the run instead of falling back.
export ACTORQ_REQUIRE_KERNEL="${ACTORQ_REQUIRE_KERNEL:-1}"
export MUJOCO_GL="${MUJOCO_GL:-disable}"
# Lint and import order first (configured in pyproject.toml): a finding fails the run.
.venv/bin/ruff check .
# One test at a time by default: on 2 cores two launcher runs at once starve each other past their
# deadlines. ACTORQ_TEST_WORKERS=N runs N pytest-xdist workers on a machine with the cores for them
# (tests/conftest.py collects the long modules first; `xdist_group` keeps shared fixtures together).
if [ "${ACTORQ_TEST_WORKERS:-1}" -gt 1 ]; then
  exec .venv/bin/python -m pytest -n "$ACTORQ_TEST_WORKERS" --dist loadgroup tests "$@"
fi
exec .venv/bin/python -m pytest tests "$@"
