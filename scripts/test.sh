#!/usr/bin/env bash
# Install kvserve with its test extra into the current Python, then run the tests.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/scheduler -x`; KVSERVE_TEST_WORKERS
# (see below) sets how many processes run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

# The files run on two worker processes (pytest-xdist; each file's tests on one worker, so that
# module fixtures such as a served cluster are set up once), one on a single-core machine;
# KVSERVE_TEST_WORKERS=N sets the number, 1 for none.  Tests marked `timing` (their assertions
# bound a time) run while no other test does: see tests/timing_lock.py.  On two cores: 8.5-10
# minutes instead of 11-12 (the Ray and server tests mostly wait).
cores="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
workers="${KVSERVE_TEST_WORKERS:-$(( cores >= 2 ? 2 : 1 ))}"
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "scripts/test.sh: KVSERVE_TEST_WORKERS must be a positive integer, got '$workers'" >&2
    exit 2
fi

# torch comes first and only when it is missing: `torch==2.13.0` is the CPU wheel
# that CPU-only development machines carry locally (pip finds it via find-links),
# and an ordinary build from the index elsewhere.  Once installed, kvserve's own
# range (`torch>=2.4`) is satisfied, so pip never resolves another (CUDA) build.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --progress-bar off "torch==2.13.0"
fi
"$PYTHON" -m pip install --progress-bar off -e ".[test]"
xdist=()
if (( workers > 1 )); then
    xdist=(-n "$workers" --dist loadfile)
fi
exec "$PYTHON" -m pytest ${xdist[@]+"${xdist[@]}"} "$@"
