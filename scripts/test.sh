#!/usr/bin/env bash
# Install kvserve with its test extra into the current Python, then run the tests.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/scheduler -x`; KVSERVE_TEST_WORKERS
# (see below) runs the tests on several processes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

# torch comes first and only when it is missing: `torch==2.13.0` is the CPU wheel
# that CPU-only development machines carry locally (pip finds it via find-links),
# and an ordinary build from the index elsewhere.  Once installed, kvserve's own
# range (`torch>=2.4`) is satisfied, so pip never resolves another (CUDA) build.
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --progress-bar off "torch==2.13.0"
fi
"$PYTHON" -m pip install --progress-bar off -e ".[test]"
# KVSERVE_TEST_WORKERS=N runs the files on N worker processes (pytest-xdist, each file's tests
# on one worker, so that module fixtures such as a served cluster are set up once).  On two
# cores N=2 takes about 8 minutes instead of 13 (the Ray and server tests mostly wait), but
# the load makes timing-bound tests flaky: of 4 runs, two failed the fault benchmark's kill
# (its streams since made longer) and one a progress report's bound.  Hence one process by default.
workers=()
if [[ -n "${KVSERVE_TEST_WORKERS:-}" ]]; then
    workers=(-n "$KVSERVE_TEST_WORKERS" --dist loadfile)
fi
exec "$PYTHON" -m pytest ${workers[@]+"${workers[@]}"} "$@"
