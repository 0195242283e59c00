#!/usr/bin/env bash
# Sets up .venv (see setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Benchmark peers (ONNX Runtime) for the peers.py smoke test; reinstalled only when the file changes.
[ .venv/.actorq-bench-installed -nt requirements-bench.txt ] || { .venv/bin/python -m uv pip install --quiet --compile-bytecode --python .venv/bin/python -r requirements-bench.txt && touch .venv/.actorq-bench-installed; }
# CI's machine has a compiler: a kernel that did not build fails the run instead of falling back.
export ACTORQ_REQUIRE_KERNEL="${ACTORQ_REQUIRE_KERNEL:-1}"
export MUJOCO_GL="${MUJOCO_GL:-disable}"
# Lint and import order first (configured in pyproject.toml): a finding fails the run.
.venv/bin/ruff check .
# Two pytest-xdist workers where there are two cores (CI has 2): a launcher run leaves a core idle while it waits on
# restarts, timeouts and its own start-up, which the other worker fills. ACTORQ_TEST_WORKERS=N sets N (1: serial).
# tests/conftest.py collects the long modules first; `xdist_group` keeps a module's shared fixture on one worker.
WORKERS="${ACTORQ_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 1 ))}"
# A worker that dies (a crash in native code, a test past its timeout) is not replaced: its test is reported failed
# and the other worker runs the rest. A replacement worker under loadgroup scheduling can sit idle while the run
# waits for it until CI's limit.
if [ "$WORKERS" -gt 1 ]; then
  exec .venv/bin/python -m pytest -n "$WORKERS" --dist loadgroup --max-worker-restart 0 tests "$@"
fi
exec .venv/bin/python -m pytest tests "$@"
