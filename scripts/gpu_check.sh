#!/usr/bin/env bash
# Everything the GPU path needs checked on a GPU machine, in one call of at most 9 minutes (its budget, below):
# build (timed), the GPU tests, and bench.gpu_serving on the Llama-3-8B and Llama-3.2-1B
# shapes (random weights): decode steps eager and graphed against their floors (both shapes),
# prefill attention against dense FlashAttention and the end-to-end workloads against
# transformers (8B: part (b) does not depend on the shape, and the issue's workload target is
# the 8B's), and the mixed workload through the step protocol over gRPC against in-process, with
# where the worker's steps went (1B, where the step protocol's target is unmet); and the layer's
# small kernels, the CUDA extension's against Triton's (host and device time per call).
# Logs go to $OUT (default /tmp/kvserve-gpu-check); the end of each step is printed.
#
#   bash scripts/gpu_check.sh              # the default steps: build tests layerops serving1b serving8b
#   bash scripts/gpu_check.sh "tests"      # some steps: build | sass | tests | layerops | serving8b | serving1b
#                                          #   | attention | calibrate (sass, attention and calibrate: on request only)
# Part (d) of gpu_serving (through `kvserve serve` and gRPC) needs Ray on the machine; the
# serving steps skip it unless SERVING_PARTS (8B) or SERVING_PARTS_1B say otherwise.  Part (e)
# (the step protocol over gRPC on loopback: a worker server in a child process, no Ray) runs the
# mixed workload in process and over gRPC, about 60 s (the child loads the model and captures
# its graphs, then three runs).  NOTE: session 46's run with the 1B shape on "ace" took 468 s
# and lost part (e) to the time limit, on a machine whose host was 1.3-1.5x slower; hence
# the 1B shape's default "ae".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvserve-gpu-check}"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export KVSERVE_CACHE_DIR="${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache}"
mkdir -p "$OUT"
steps="${1:-build tests layerops serving1b serving8b}"
SERVING_PARTS="${SERVING_PARTS:-abc}"
SERVING_PARTS_1B="${SERVING_PARTS_1B:-ae}"
status=0
# The whole call's budget: each step's time limit is its own or what is left of the budget
# (less 10 s to print), the shorter, so that a slow step shortens the later ones instead of
# the device tool's limit (600 s a command) cutting the run and its output.  The 1B shape runs
# before the 8B: its part (e) is short and is where the step protocol's open question is, and
# the 8B's part (a) prints each row as it is measured, so a cut there still leaves rows.
BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
limit() {
    local left=$(( BUDGET_S - SECONDS - 10 ))
    (( left < 1 )) && left=1
    (( left < $1 )) && echo "$left" || echo "$1"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
# kvserve itself only: torch, transformers and the rest come with the machine's image.
if ! "$PYTHON" -c "import kvserve.kernels" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1 \
        || { tail -20 "$OUT/install.txt"; exit 1; }
fi
# The image's packages are not upgraded (--no-deps, and the machine is offline): say at once if
# they are older than the generated gRPC code needs, instead of losing the tests and part (e).
if ! preflight=$("$PYTHON" -c "import kvserve.proto.step_pb2_grpc, kvserve.proto.generate_pb2_grpc" 2>&1); then
    echo "$preflight" | tail -1; echo "the generated gRPC code does not import with this image's packages"; exit 1
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
    timeout "$(limit 240)" "$PYTHON" -m pytest -m gpu tests/kernels/test_flash_prefill.py tests/worker/test_cuda_graphs.py \
        tests/engine/test_llm_shutdown.py tests/engine/test_llm_cuda_parity.py tests/kernels/test_cuda_backend.py \
        tests/worker/test_sampler.py tests/worker/test_sampler_min_p.py tests/kernels/test_fused_elementwise.py \
        tests/engine/test_llm_async_scheduling.py tests/cluster/test_step_protocol_cuda.py -q -p no:cacheprovider --timeout 120 -rfE --tb=short --durations=8 >"$OUT/tests.txt" 2>&1 || status=1
    tail -25 "$OUT/tests.txt"
fi

# The layer's small kernels from the CUDA extension are new (session 47, written without a GPU):
# if their tests or their benchmark fail, the serving steps run on Triton's instead, and say so,
# so that one broken kernel does not cost every figure of the run.
extension_failed() {
    echo "!! the extension's layer kernels failed ($1): serving steps use KVSERVE_FUSED_KERNELS=triton"
    export KVSERVE_FUSED_KERNELS=triton
}
if [[ " $steps " == *" tests "* ]] && grep -qE "(FAILED|ERROR) tests/kernels/test_fused_elementwise.py::[a-z_]*(\[cuda\]|extension)" "$OUT/tests.txt"; then
    extension_failed "gpu tests"
fi
if [[ " $steps " == *" layerops "* ]]; then
    echo "== the layer's small kernels: CUDA extension against Triton"
    timeout "$(limit 90)" "$PYTHON" -m kvserve.bench.layer_ops >"$OUT/layer_ops.txt" 2>&1 || { status=1; extension_failed "bench.layer_ops"; }
    tail -12 "$OUT/layer_ops.txt"
fi

for shape in 1b 8b; do
    if [[ " $steps " == *" serving$shape "* ]]; then
        name=$([[ $shape == 8b ]] && echo llama-3-8b || echo llama-3.2-1b)
        echo "== gpu_serving --shape $name"
        parts=$([[ $shape == 8b ]] && echo "$SERVING_PARTS" || echo "$SERVING_PARTS_1B")
        timeout "$(limit "$([[ $shape == 8b ]] && echo 270 || echo 180)")" "$PYTHON" -m kvserve.bench.gpu_serving --shape "$name" \
            --parts "$parts" >"$OUT/serving_$shape.txt" 2>&1 || status=1
        grep -v "^Loading weights" "$OUT/serving_$shape.txt" | tail -$([[ $parts == *e* ]] && echo 82 || echo 58)
    fi
done

if [[ " $steps " == *" attention "* ]]; then
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
echo "== gpu_check took $SECONDS s (budget $BUDGET_S s, GPU_CHECK_BUDGET_S)"
exit $status
