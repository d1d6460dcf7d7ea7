// Torch binding of the CUDA paged-attention kernels: argument checks, device and stream,
// split workspace.  Compiled by the host compiler in the GPU build only (torch's CPU wheel
// lacks part of c10/cuda); the kernels live in paged_attention_cuda.cu.
//
// NOTE: not <torch/extension.h>: it pulls in all of torch's C++ API and triples the
// compile time.  These are all this file uses.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "check_message.h"
#include "layer_ops_binding.h"
#include "paged_attention_cuda.h"

namespace {

constexpr int64_t kMaxGridYZ = 65535;

using kvserve::check::fail;
using kvserve::check::require;

kvserve::DType kernel_dtype(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kFloat: return kvserve::DType::kFloat32;
    case at::kHalf: return kvserve::DType::kFloat16;
    case at::kBFloat16: return kvserve::DType::kBFloat16;
    default: break;
  }
  fail("expected float32, float16 or bfloat16 tensors, got ", tensor.scalar_type());
}

void check_on_device(const at::Tensor& tensor, const at::Device& device, const char* name) {
  require(tensor.is_cuda() && tensor.device() == device, name, " must be on ", device, ", got ",
          tensor.device());
}

// The kernels read and write 16 bytes at a time along the last dimension.
void check_vectorizable(const at::Tensor& tensor, const char* name) {
  const int64_t elems_per_vector = 16 / static_cast<int64_t>(tensor.element_size());
  require(tensor.stride(-1) == 1, name, " must be contiguous in its last dimension, got strides ",
          tensor.strides());
  for (int64_t dim = 0; dim + 1 < tensor.dim(); ++dim) {
    require(tensor.stride(dim) % elems_per_vector == 0, name, " strides ", tensor.strides(),
            " must be multiples of ", elems_per_vector, " elements (16 bytes)");
  }
  require(reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 16 == 0, name,
          " must start on a 16-byte boundary");
}

void check_cache(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  require(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
          "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got ",
          key_cache.sizes(), " and ", value_cache.sizes());
  require(key_cache.is_contiguous() && value_cache.is_contiguous(), "the caches must be contiguous");
  require(key_cache.scalar_type() == value_cache.scalar_type(), "the caches must share one dtype");
  require(key_cache.size(2) >= 1, "num_kv_heads must be at least 1");
  check_vectorizable(key_cache, "key_cache");
  check_vectorizable(value_cache, "value_cache");
}

void check_int_tensor(const at::Tensor& tensor, at::ScalarType dtype, at::IntArrayRef sizes, const char* name) {
  require(tensor.scalar_type() == dtype, name, " must be ", dtype, ", got ", tensor.scalar_type());
  require(tensor.sizes() == sizes, name, " must have shape ", sizes, ", got ", tensor.sizes());
  require(tensor.is_contiguous(), name, " must be contiguous");
}

}  // namespace

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cache(key_cache, value_cache);
  require(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == key_cache.size(2) &&
              key.size(2) == key_cache.size(3),
          "key and value must be [num_tokens, num_kv_heads, head_dim] matching the cache ",
          key_cache.sizes(), ", got ", key.sizes(), " and ", value.sizes());
  require(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(),
          "key, value and the caches must share one dtype, got ", key.scalar_type(), ", ",
          value.scalar_type(), " and ", key_cache.scalar_type());
  kernel_dtype(key);
  require(key.size(2) * key.element_size() % 16 == 0, "head_dim * element size must be a multiple of 16 bytes");
  require(key.size(0) <= std::numeric_limits<int32_t>::max(), "too many tokens: ", key.size(0));
  check_vectorizable(key, "key");
  check_vectorizable(value, "value");
  check_int_tensor(slot_mapping, at::kLong, {key.size(0)}, "slot_mapping");
  const at::Device device = key_cache.device();
  check_on_device(key_cache, device, "key_cache");
  check_on_device(value_cache, device, "value_cache");
  check_on_device(key, device, "key");
  check_on_device(value, device, "value");
  check_on_device(slot_mapping, device, "slot_mapping");
  if (key.size(0) == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  kvserve::CacheWriteParams params{};
  params.key = key.data_ptr();
  params.value = value.data_ptr();
  params.key_cache = key_cache.data_ptr();
  params.value_cache = value_cache.data_ptr();
  params.slot_mapping = slot_mapping.data_ptr<int64_t>();
  params.key_token_stride = key.stride(0);
  params.key_head_stride = key.stride(1);
  params.value_token_stride = value.stride(0);
  params.value_head_stride = value.stride(1);
  params.num_tokens = static_cast<int32_t>(key.size(0));
  params.num_kv_heads = static_cast<int32_t>(key.size(1));
  params.head_dim = static_cast<int32_t>(key.size(2));
  params.element_size = static_cast<int32_t>(key.element_size());
  C10_CUDA_CHECK(kvserve::launch_write_kv_cache(params, c10::cuda::getCurrentCUDAStream().stream()));
}

void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, double scale, int64_t split_tokens,
                     int64_t num_decode_splits, int64_t num_prefill_splits, bool even_splits) {
  check_cache(key_cache, value_cache);
  require(query.dim() == 3, "query must be [num_tokens, num_heads, head_dim], got ", query.sizes());
  require(out.sizes() == query.sizes() && out.is_contiguous(), "out must be contiguous with query's shape ",
          query.sizes(), ", got ", out.sizes());
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  require(key_cache.size(3) == head_dim, "query head_dim ", head_dim, " != cache head_dim ", key_cache.size(3));
  require(num_heads >= 1, "query must have at least one head, got ", num_heads);
  require(num_heads % num_kv_heads == 0, "num_heads ", num_heads, " is not a multiple of num_kv_heads ",
          num_kv_heads);
  require(kvserve::is_supported_head_dim(head_dim), "head_dim ", head_dim,
          " is not supported by the CUDA kernels (supported: 64, 128)");
  require(kvserve::is_supported_block_size(block_size), "block_size ", block_size,
          " is not supported by the CUDA kernels (supported: 16, 32)");
  const kvserve::DType dtype = kernel_dtype(query);
  require(out.scalar_type() == query.scalar_type() && key_cache.scalar_type() == query.scalar_type(),
          "out, query and the caches must share one dtype, got ", out.scalar_type(), ", ",
          query.scalar_type(), " and ", key_cache.scalar_type());
  check_vectorizable(query, "query");
  check_vectorizable(out, "out");
  const int64_t num_reqs = seq_lens.size(0);
  require(block_tables.dim() == 2, "block_tables must be [num_reqs, max_blocks], got ", block_tables.sizes());
  check_int_tensor(seq_lens, at::kInt, {num_reqs}, "seq_lens");
  check_int_tensor(block_tables, at::kInt, {num_reqs, block_tables.size(1)}, "block_tables");
  check_int_tensor(query_start_loc, at::kInt, {num_reqs + 1}, "query_start_loc");
  require(split_tokens > 0 && split_tokens % kvserve::kSplitTokensMultiple == 0 &&
              split_tokens <= kvserve::kMaxSplitTokens,
          "split_tokens must be a positive multiple of ", kvserve::kSplitTokensMultiple, " up to ",
          kvserve::kMaxSplitTokens, ", got ", split_tokens);
  // NOTE: the split counts are trusted, not checked against seq_lens (on the device): each
  // must be ceil(longest context of its launch / split_tokens), 0 only when the launch has
  // no request.  Fewer leave output rows unwritten or combine partials never written;
  // kvserve.kernels.cuda_plan.plan_splits computes them.  With even_splits each request's
  // split size comes from its context on the device; the counts must still cover every
  // context in splits of at most MAX_SPLIT_TOKENS (a plan for the longest context does).
  require(num_decode_splits >= 0 && num_decode_splits <= kMaxGridYZ && num_prefill_splits >= 0 &&
              num_prefill_splits <= kMaxGridYZ,
          "split counts must be in [0, ", kMaxGridYZ, "], got ", num_decode_splits, " and ", num_prefill_splits);
  require(num_decode_splits == 0 || num_reqs <= kMaxGridYZ, "at most ", kMaxGridYZ,
          " requests per decode launch, got ", num_reqs);
  require(num_tokens <= std::numeric_limits<int32_t>::max() / num_heads, "too many tokens: ", num_tokens);
  require(num_reqs >= 1 || num_tokens == 0, "a batch with tokens needs at least one request");
  const at::Device device = query.device();
  check_on_device(query, device, "query");
  check_on_device(out, device, "out");
  check_on_device(key_cache, device, "key_cache");
  check_on_device(value_cache, device, "value_cache");
  check_on_device(block_tables, device, "block_tables");
  check_on_device(seq_lens, device, "seq_lens");
  check_on_device(query_start_loc, device, "query_start_loc");
  if (num_tokens == 0) return;

  const c10::cuda::CUDAGuard guard(device);
  const int64_t max_splits = std::max(num_decode_splits, num_prefill_splits);
  at::Tensor partial_out, partial_max, partial_sum;
  if (max_splits > 1) {
    const auto options = query.options().dtype(at::kFloat);
    partial_out = query.new_empty({num_tokens, num_heads, max_splits, head_dim}, options);
    partial_max = query.new_empty({num_tokens, num_heads, max_splits}, options);
    partial_sum = query.new_empty({num_tokens, num_heads, max_splits}, options);
  }
  kvserve::AttentionParams params{};
  params.out = out.data_ptr();
  params.query = query.data_ptr();
  params.key_cache = key_cache.data_ptr();
  params.value_cache = value_cache.data_ptr();
  params.block_tables = block_tables.data_ptr<int32_t>();
  params.seq_lens = seq_lens.data_ptr<int32_t>();
  params.query_start_loc = query_start_loc.data_ptr<int32_t>();
  params.partial_out = max_splits > 1 ? partial_out.data_ptr<float>() : nullptr;
  params.partial_max = max_splits > 1 ? partial_max.data_ptr<float>() : nullptr;
  params.partial_sum = max_splits > 1 ? partial_sum.data_ptr<float>() : nullptr;
  params.query_token_stride = query.stride(0);
  params.query_head_stride = query.stride(1);
  params.num_reqs = static_cast<int32_t>(num_reqs);
  params.num_tokens = static_cast<int32_t>(num_tokens);
  params.num_heads = static_cast<int32_t>(num_heads);
  params.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  params.head_dim = static_cast<int32_t>(head_dim);
  params.block_size = static_cast<int32_t>(block_size);
  params.max_blocks_per_req = static_cast<int32_t>(block_tables.size(1));
  params.split_tokens = static_cast<int32_t>(split_tokens);
  params.even_splits = even_splits ? 1 : 0;
  params.max_splits = static_cast<int32_t>(max_splits);
  params.num_decode_splits = static_cast<int32_t>(num_decode_splits);
  params.num_prefill_splits = static_cast<int32_t>(num_prefill_splits);
  params.scale = static_cast<float>(scale);
  params.dtype = dtype;
  C10_CUDA_CHECK(kvserve::launch_paged_attention(params, c10::cuda::getCurrentCUDAStream().stream()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv_cache", &write_kv_cache,
        "Write each token's key and value into cache slot slot_mapping[token] (slots < 0 skipped).",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("paged_attention", &paged_attention,
        "Causal attention of a mixed batch over the paged cache, into out.  Requests with one new "
        "token run num_decode_splits context splits of split_tokens, the others num_prefill_splits; "
        "with even_splits, each request's context is cut into its launch's split count instead.",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"), py::arg("split_tokens"),
        py::arg("num_decode_splits"), py::arg("num_prefill_splits"), py::arg("even_splits") = false);
  m.attr("MAX_SPLIT_TOKENS") = kvserve::kMaxSplitTokens;
  m.attr("SPLIT_TOKENS_MULTIPLE") = kvserve::kSplitTokensMultiple;
  m.attr("PREFILL_ROWS") = kvserve::kPrefillRows;
  kvserve::register_layer_ops(m);
}
