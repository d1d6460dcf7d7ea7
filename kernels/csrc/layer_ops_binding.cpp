// Torch binding of the decoder layer's small CUDA kernels: argument checks, outputs, device
// and stream.  Compiled by the host compiler in the GPU build only, like
// paged_attention_cuda_binding.cpp; the kernels live in layer_ops_cuda.cu.
#include "layer_ops_binding.h"

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "check_message.h"
#include "layer_ops_cuda.h"

namespace kvserve {
namespace {

using check::fail;
using check::require;

DType half_dtype(const at::Tensor& tensor, const char* name) {
  switch (tensor.scalar_type()) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: break;
  }
  fail(name, " must be float16 or bfloat16, got ", tensor.scalar_type());
}

// A CUDA tensor of `like`'s dtype on its device, contiguous in its last dimension.
void check_like(const at::Tensor& tensor, const at::Tensor& like, const char* name) {
  require(tensor.is_cuda() && tensor.device() == like.device(), name, " must be on ", like.device(), ", got ",
          tensor.device());
  require(tensor.scalar_type() == like.scalar_type(), name, " must be ", like.scalar_type(), ", got ",
          tensor.scalar_type());
  require(tensor.dim() >= 1 && tensor.stride(-1) == 1, name, " must be contiguous in its last dimension, got strides ",
          tensor.strides());
}

void check_rows(const at::Tensor& tensor, const char* name) {
  require(tensor.dim() == 2, name, " must be [rows, width], got ", tensor.sizes());
  require(tensor.is_cuda(), name, " must be on a CUDA device, got ", tensor.device());
  require(tensor.stride(-1) == 1, name, " must be contiguous in its last dimension, got strides ",
          tensor.strides());
  require(tensor.size(0) <= std::numeric_limits<int32_t>::max() &&
              tensor.size(1) <= std::numeric_limits<int32_t>::max(),
          name, " is too large: ", tensor.sizes());
}

std::tuple<at::Tensor, std::optional<at::Tensor>> add_rms_norm(const at::Tensor& x,
                                                               const std::optional<at::Tensor>& residual,
                                                               const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const DType dtype = half_dtype(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  require(hidden >= 1, "x must have at least one column");
  check_like(weight, x, "weight");
  require(weight.dim() == 1 && weight.size(0) == hidden, "weight must be [", hidden, "], got ", weight.sizes());
  if (residual.has_value()) {
    check_like(*residual, x, "residual");
    require(residual->sizes() == x.sizes(), "residual must have x's shape ", x.sizes(), ", got ", residual->sizes());
  }
  at::Tensor out = x.new_empty({rows, hidden});
  std::optional<at::Tensor> residual_out;
  if (residual.has_value()) residual_out = x.new_empty({rows, hidden});
  if (rows == 0) return {out, residual_out};

  const c10::cuda::CUDAGuard guard(x.device());
  RmsNormParams params{};
  params.x = x.data_ptr();
  params.residual = residual.has_value() ? residual->data_ptr() : nullptr;
  params.weight = weight.data_ptr();
  params.out = out.data_ptr();
  params.residual_out = residual_out.has_value() ? residual_out->data_ptr() : nullptr;
  params.x_stride = x.stride(0);
  params.residual_stride = residual.has_value() ? residual->stride(0) : 0;
  params.rows = static_cast<int32_t>(rows);
  params.hidden = static_cast<int32_t>(hidden);
  params.eps = static_cast<float>(eps);
  params.dtype = dtype;
  C10_CUDA_CHECK(launch_add_rms_norm(params, c10::cuda::getCurrentCUDAStream().stream()));
  return {out, residual_out};
}

at::Tensor rope_and_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& slot_mapping, int64_t num_heads) {
  check_rows(qkv, "qkv");
  const DType dtype = half_dtype(qkv, "qkv");
  require(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
          "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got ",
          key_cache.sizes(), " and ", value_cache.sizes());
  require(key_cache.is_contiguous() && value_cache.is_contiguous(), "the caches must be contiguous");
  check_like(key_cache, qkv, "key_cache");
  check_like(value_cache, qkv, "value_cache");
  const int64_t num_tokens = qkv.size(0), num_kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  require(num_heads >= 1 && num_kv_heads >= 1 && head_dim >= 2 && head_dim % 2 == 0,
          "need at least one q and one kv head of an even head_dim, got ", num_heads, ", ", num_kv_heads, " and ",
          head_dim);
  require(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv rows of ", qkv.size(1), " are not ",
          num_heads, " + 2 x ", num_kv_heads, " heads of ", head_dim);
  require(num_heads + num_kv_heads <= 65535, "too many heads: ", num_heads + num_kv_heads);
  for (const at::Tensor* angle : {&cos, &sin}) {
    check_like(*angle, qkv, "cos and sin");
    require(angle->dim() == 2 && angle->size(0) == num_tokens && angle->size(1) == head_dim / 2,
            "cos and sin must be [", num_tokens, ", ", head_dim / 2, "], got ", angle->sizes());
  }
  require(sin.strides() == cos.strides(), "cos and sin must have the same strides, got ", cos.strides(), " and ",
          sin.strides());
  require(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens &&
              slot_mapping.is_contiguous() && slot_mapping.device() == qkv.device(),
          "slot_mapping must be a contiguous int64 [", num_tokens, "] on ", qkv.device());
  at::Tensor query = qkv.new_empty({num_tokens, num_heads, head_dim});
  if (num_tokens == 0) return query;

  const c10::cuda::CUDAGuard guard(qkv.device());
  RopeWriteParams params{};
  params.qkv = qkv.data_ptr();
  params.cos = cos.data_ptr();
  params.sin = sin.data_ptr();
  params.slot_mapping = slot_mapping.data_ptr<int64_t>();
  params.query = query.data_ptr();
  params.key_cache = key_cache.data_ptr();
  params.value_cache = value_cache.data_ptr();
  params.qkv_stride = qkv.stride(0);
  params.cos_stride = cos.stride(0);
  params.num_tokens = static_cast<int32_t>(num_tokens);
  params.num_heads = static_cast<int32_t>(num_heads);
  params.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  params.head_dim = static_cast<int32_t>(head_dim);
  params.dtype = dtype;
  C10_CUDA_CHECK(launch_rope_and_write_kv(params, c10::cuda::getCurrentCUDAStream().stream()));
  return query;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  const DType dtype = half_dtype(x, "x");
  require(x.size(1) % 2 == 0, "x must have an even width, got ", x.size(1));
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  at::Tensor out = x.new_empty({rows, d});
  if (rows == 0 || d == 0) return out;

  const c10::cuda::CUDAGuard guard(x.device());
  SiluMulParams params{};
  params.x = x.data_ptr();
  params.out = out.data_ptr();
  params.x_stride = x.stride(0);
  params.rows = static_cast<int32_t>(rows);
  params.d = static_cast<int32_t>(d);
  params.dtype = dtype;
  C10_CUDA_CHECK(launch_silu_and_mul(params, c10::cuda::getCurrentCUDAStream().stream()));
  return out;
}

}  // namespace

void register_layer_ops(pybind11::module_& module) {
  module.def("add_rms_norm", &add_rms_norm,
             "(weight * norm(x + residual), x + residual) of half-precision rows; without a residual "
             "(weight * norm(x), None).",
             pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"));
  module.def("rope_and_write_kv", &rope_and_write_kv,
             "The rotated q heads of packed qkv rows; their rotated k heads and v heads written into the "
             "caches at slot_mapping (slots < 0 skipped).",
             pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("key_cache"),
             pybind11::arg("value_cache"), pybind11::arg("slot_mapping"), pybind11::arg("num_heads"));
  module.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:] of half-precision rows [n, 2d].",
             pybind11::arg("x"));
}

}  // namespace kvserve
