// Launchers of the decoder layer's small kernels (layer_ops_kernels.cuh): dtype and vector
// width dispatch.  Only CUDA's own headers, like paged_attention_cuda.cu.
#include <algorithm>

#include "layer_ops_kernels.cuh"

namespace kvserve {
namespace {

using layer_ops::kWarp;

constexpr int kVecElems = 8;  // 16 bytes of half precision
constexpr int kMaxThreads = 1024;
constexpr int kSiluThreads = 256;
constexpr int64_t kMaxGridY = 65535;

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Whole warps, enough for one pack each where the row allows, at least one warp.
int threads_for(int64_t packs) {
  const int64_t warps = (packs + kWarp - 1) / kWarp;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(warps, 1) * kWarp, kMaxThreads));
}

template <typename T, int kVec>
cudaError_t launch_rms(const RmsNormParams& p, cudaStream_t stream) {
  layer_ops::add_rms_norm_kernel<T, kVec><<<p.rows, threads_for(p.hidden / kVec), 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_rms(const RmsNormParams& p, cudaStream_t stream) {
  const bool residual_vectors =
      p.residual == nullptr || (p.residual_stride % kVecElems == 0 && aligned16(p.residual) && aligned16(p.residual_out));
  const bool vectors = p.hidden % kVecElems == 0 && p.x_stride % kVecElems == 0 && aligned16(p.x) &&
                       aligned16(p.weight) && aligned16(p.out) && residual_vectors;
  return vectors ? launch_rms<T, kVecElems>(p, stream) : launch_rms<T, 1>(p, stream);
}

template <typename T, int kVec>
cudaError_t launch_silu(const SiluMulParams& p, cudaStream_t stream) {
  const int64_t packs = p.d / kVec;
  const int64_t blocks_per_row = (packs + kSiluThreads - 1) / kSiluThreads;
  if (blocks_per_row > kMaxGridY) return cudaErrorInvalidValue;
  const dim3 grid(p.rows, static_cast<unsigned>(blocks_per_row));
  layer_ops::silu_and_mul_kernel<T, kVec><<<grid, kSiluThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_silu(const SiluMulParams& p, cudaStream_t stream) {
  const bool vectors = p.d % kVecElems == 0 && p.x_stride % kVecElems == 0 && aligned16(p.x) && aligned16(p.out);
  return vectors ? launch_silu<T, kVecElems>(p, stream) : launch_silu<T, 1>(p, stream);
}

template <typename T>
cudaError_t launch_rope(const RopeWriteParams& p, cudaStream_t stream) {
  const dim3 grid(p.num_tokens, p.num_heads + p.num_kv_heads);
  layer_ops::rope_and_write_kv_kernel<T><<<grid, threads_for(p.head_dim / 2), 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_add_rms_norm(const RmsNormParams& params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  if (params.hidden <= 0) return cudaErrorInvalidValue;
  switch (params.dtype) {
    case DType::kFloat16: return dispatch_rms<__half>(params, stream);
    case DType::kBFloat16: return dispatch_rms<__nv_bfloat16>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_rope_and_write_kv(const RopeWriteParams& params, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  if (params.head_dim <= 0 || params.head_dim % 2 != 0 || params.num_heads + params.num_kv_heads > kMaxGridY) {
    return cudaErrorInvalidValue;
  }
  switch (params.dtype) {
    case DType::kFloat16: return launch_rope<__half>(params, stream);
    case DType::kBFloat16: return launch_rope<__nv_bfloat16>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_silu_and_mul(const SiluMulParams& params, cudaStream_t stream) {
  if (params.rows == 0 || params.d == 0) return cudaSuccess;
  switch (params.dtype) {
    case DType::kFloat16: return dispatch_silu<__half>(params, stream);
    case DType::kBFloat16: return dispatch_silu<__nv_bfloat16>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace kvserve
