#!/usr/bin/env bash
# Everything the CUDA attention kernels need checked on a GPU machine, in one call:
# build (timed), resource usage and SASS of the built kernels, the GPU tests, the benchmark,
# and the step cost model calibrated on a Llama-3-8B-sized model (random weights).
# Logs go to $OUT (default /tmp/kvserve-gpu-check); the end of each step is printed.
#
#   bash scripts/gpu_check.sh              # all steps
#   bash scripts/gpu_check.sh tests        # one step: build | sass | tests | bench | calibrate
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvserve-gpu-check}"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export KVSERVE_CACHE_DIR="${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache}"
mkdir -p "$OUT"
steps="${1:-build sass tests bench calibrate}"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# kvserve itself only: torch, transformers and the rest come with the machine's image.
if ! "$PYTHON" -c "import kvserve.kernels" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1 \
        || { tail -20 "$OUT/install.txt"; exit 1; }
fi

if [[ " $steps " == *" build "* ]]; then
    echo "== build"
    "$PYTHON" - <<'EOF' 2>&1 | tee "$OUT/build.txt"
import time, torch
from kvserve.kernels.cuda_build import build_directory, cuda_arch_flags, load_cuda_extension
start = time.perf_counter()
load_cuda_extension()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}: built and loaded "
      f"in {time.perf_counter() - start:.1f} s, {build_directory(cuda_arch_flags()[1])}")
EOF
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi

if [[ " $steps " == *" sass "* ]]; then
    echo "== resource usage and SASS"
    library=$(ls "$KVSERVE_CACHE_DIR"/torch_extensions/*/kvserve_paged_attention_cuda_*/*.so | head -1)
    cuobjdump -res-usage "$library" >"$OUT/res_usage.txt" 2>&1
    cuobjdump -sass "$library" >"$OUT/sass.txt" 2>&1
    grep -E "Function|REG|STACK|LOCAL" "$OUT/res_usage.txt" | paste - - | sed -E 's/ +/ /g' | c++filt | cut -c1-220 | head -40
    echo "128-bit global loads: $(grep -cE 'LDG\.E[A-Z0-9_.]*\.128' "$OUT/sass.txt"); local loads/stores: $(grep -cE 'LDL|STL' "$OUT/sass.txt")"
fi

if [[ " $steps " == *" tests "* ]]; then
    echo "== GPU tests"
    "$PYTHON" -m pytest -m gpu tests/kernels tests/engine/test_llm_cuda_parity.py tests/worker/test_sampler.py -q -p no:cacheprovider \
        >"$OUT/tests.txt" 2>&1 || status=1
    tail -25 "$OUT/tests.txt"
fi

if [[ " $steps " == *" bench "* ]]; then
    echo "== benchmark"
    "$PYTHON" -m kvserve.bench.attention --prefill --json "$OUT/attention.json" >"$OUT/bench.txt" 2>&1 || status=1
    tail -40 "$OUT/bench.txt"
fi
if [[ " $steps " == *" calibrate "* ]]; then
    echo "== step cost model, llama-3-8b shape"
    # Shapes up to the experiments' defaults: a 2048-token budget, decode batches to 128.
    "$PYTHON" -m kvserve.bench.calibrate_cost_model --shape llama-3-8b --device cuda \
        --prefill-lengths 16,128,256,512,1024,2048 --decode-batches 1,8,32,128 --context-lengths 256,2048 --repeats 5 \
        --out "$OUT/cost_model_llama3_8b.json" >"$OUT/calibrate.txt" 2>&1 || status=1
    tail -40 "$OUT/calibrate.txt"
fi
exit $status
