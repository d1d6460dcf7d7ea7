// Host interface of the CUDA paged-attention kernels: plain structs of raw pointers and
// launch functions, so that the kernels' translation unit (paged_attention_cuda.cu) needs
// only CUDA's own headers and the torch binding (paged_attention_cuda_binding.cpp) needs
// no CUDA device code.  See paged_attention_kernels.cuh for the algorithm.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvserve {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Threads of one attention CTA (4 warps).
constexpr int kNumThreads = 128;
// Query rows ((token, head) pairs of one KV head) per prefill CTA.
constexpr int kPrefillRows = 8;
// Largest GQA tile of one decode CTA; larger groups take several CTAs per KV head.
constexpr int kMaxDecodeRows = 8;
// A CTA stages the block ids of its context split in shared memory: splits are bounded.
constexpr int kMaxSplitTokens = 8192;
// Splits start on a block boundary for every supported block size.
constexpr int kSplitTokensMultiple = 64;
// The smallest split worth a CTA's start-up (kvserve.kernels.cuda_plan.MIN_SPLIT_TOKENS).
constexpr int kMinSplitTokens = 128;

constexpr bool is_supported_head_dim(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }
constexpr bool is_supported_block_size(int64_t block_size) { return block_size == 16 || block_size == 32; }

// Query heads per decode CTA: 1 (MHA), 4 (groups of 2-4) or 8 (larger groups, in tiles of
// 8).  Rows beyond the group cost arithmetic but no memory traffic, and decode is bound by
// memory; fewer variants keep the build (and the CI compile check) short.
constexpr int decode_rows_for_group(int64_t group) {
  return group <= 1 ? 1 : group <= 4 ? 4 : kMaxDecodeRows;
}

// One mixed batch (see kernels/attention_metadata.py).  Element strides, not bytes.
struct AttentionParams {
  void* out;                // [num_tokens, num_heads, head_dim], contiguous
  const void* query;        // [num_tokens, num_heads, head_dim], strides below, last dim contiguous
  const void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const void* value_cache;  // same
  const int32_t* block_tables;     // [num_reqs, max_blocks_per_req]
  const int32_t* seq_lens;         // [num_reqs]
  const int32_t* query_start_loc;  // [num_reqs + 1]
  // Split partials, [num_tokens, num_heads, max_splits(, head_dim)]; null when max_splits == 1.
  float* partial_out;
  float* partial_max;
  float* partial_sum;
  int64_t query_token_stride;
  int64_t query_head_stride;
  int32_t num_reqs;
  int32_t num_tokens;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t block_size;
  int32_t max_blocks_per_req;
  int32_t split_tokens;        // context tokens per split, a multiple of kSplitTokensMultiple
  // 0: every request's splits are split_tokens long.  1: each request's context is cut into
  // its launch's split count of even splits (split_tokens_of in paged_attention_kernels.cuh),
  // read from seq_lens on the device: a launch captured in a CUDA graph for long contexts
  // then keeps as many CTAs busy on short ones as a launch planned for them.  The split
  // counts must then cover every context in splits of at most kMaxSplitTokens.
  int32_t even_splits;
  int32_t max_splits;          // max(num_decode_splits, num_prefill_splits)
  int32_t num_decode_splits;   // 0: no request has a single new token
  int32_t num_prefill_splits;  // 0: no request has several new tokens
  float scale;
  DType dtype;
};

// New K/V rows into their cache slots.  Strides in elements; slots < 0 are skipped.
struct CacheWriteParams {
  const void* key;    // [num_tokens, num_kv_heads, head_dim], last dim contiguous
  const void* value;  // same
  void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]
  int64_t key_token_stride;
  int64_t key_head_stride;
  int64_t value_token_stride;
  int64_t value_head_stride;
  int32_t num_tokens;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t element_size;  // bytes
};

// Decode rows, prefill rows and the split combine, in stream order.  Returns the first
// launch error (cudaErrorInvalidValue for a shape the kernels were not built for).
cudaError_t launch_paged_attention(const AttentionParams& params, cudaStream_t stream);

cudaError_t launch_write_kv_cache(const CacheWriteParams& params, cudaStream_t stream);

}  // namespace kvserve
