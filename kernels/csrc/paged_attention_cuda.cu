// Launchers of the CUDA paged-attention kernels: dtype / head_dim / block size / GQA tile
// dispatch onto the templates of paged_attention_kernels.cuh.  Only CUDA's own headers:
// this translation unit compiles on machines whose torch has no CUDA headers (the CI
// compile check, tests/kernels/test_cuda_compile.py).
#include "paged_attention_kernels.cuh"

namespace kvserve {
namespace {

template <typename T, int kHeadDim, int kBlockSize, int kRows>
void launch_decode(const AttentionParams& p, int group, cudaStream_t stream) {
  const int head_tiles = (group + kRows - 1) / kRows;
  const dim3 grid(p.num_kv_heads * head_tiles, p.num_reqs, p.num_decode_splits);
  paged_attention_kernel<T, kHeadDim, kBlockSize, kRows><<<grid, kNumThreads, 0, stream>>>(p, true);
}

template <typename T, int kHeadDim, int kBlockSize>
cudaError_t launch_attention(const AttentionParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  if (p.num_decode_splits > 0) {
    switch (decode_rows_for_group(group)) {
      case 1: launch_decode<T, kHeadDim, kBlockSize, 1>(p, group, stream); break;
      case 4: launch_decode<T, kHeadDim, kBlockSize, 4>(p, group, stream); break;
      default: launch_decode<T, kHeadDim, kBlockSize, kMaxDecodeRows>(p, group, stream); break;
    }
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  if (p.num_prefill_splits > 0) {
    // Enough tiles for every request (see first_prefill_tile); a decode's tiles exit at once.
    const int64_t num_tiles = static_cast<int64_t>(p.num_tokens) * group / kPrefillRows + p.num_reqs;
    const dim3 grid(static_cast<unsigned>(num_tiles), p.num_kv_heads, p.num_prefill_splits);
    paged_attention_kernel<T, kHeadDim, kBlockSize, kPrefillRows><<<grid, kNumThreads, 0, stream>>>(p, false);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  if (p.max_splits > 1) {
    constexpr int kHeadsPerCta = kNumThreads / (kHeadDim / 4);
    const dim3 grid(p.num_tokens, (p.num_heads + kHeadsPerCta - 1) / kHeadsPerCta);
    combine_splits_kernel<T, kHeadDim><<<grid, kNumThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

template <typename T, int kHeadDim>
cudaError_t dispatch_block_size(const AttentionParams& p, cudaStream_t stream) {
  switch (p.block_size) {
    case 16: return launch_attention<T, kHeadDim, 16>(p, stream);
    case 32: return launch_attention<T, kHeadDim, 32>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t dispatch_head_dim(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return dispatch_block_size<T, 64>(p, stream);
    case 128: return dispatch_block_size<T, 128>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_paged_attention(const AttentionParams& params, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  switch (params.dtype) {
    case DType::kFloat32: return dispatch_head_dim<float>(params, stream);
    case DType::kFloat16: return dispatch_head_dim<__half>(params, stream);
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_write_kv_cache(const CacheWriteParams& params, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  if (params.element_size <= 0 || 16 % params.element_size != 0 ||
      params.head_dim * params.element_size % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const int vecs_per_slot = params.num_kv_heads * params.head_dim * params.element_size / 16;
  // One thread per 16 bytes of a slot, in whole warps, at most 256 (larger slots loop).
  const int threads = vecs_per_slot >= 256 ? 256 : (vecs_per_slot + 31) / 32 * 32;
  write_kv_cache_kernel<<<params.num_tokens, threads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace kvserve
