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
exec .venv/bin/python -m pytest tests "$@"
