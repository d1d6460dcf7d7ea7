#!/usr/bin/env bash
# Install kvserve with its test extra into the current Python, then run the tests.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/scheduler -x`.
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
exec "$PYTHON" -m pytest "$@"
