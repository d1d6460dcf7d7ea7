// Paged decode attention on CPU: one query token per request, K/V read in place
// from the paged cache (no gather into a padded copy).
//
// Cache layout, per layer, keys and values alike (contiguous):
//
//   key_cache[num_blocks][block_size][num_kv_heads][head_dim]      block 0: the null block
//
//   block_tables[r] = [ 7,  2,  9,  0 ...]   position p of request r lives in block
//                       |   |   |            block_tables[r][p / block_size], at slot
//                       |   |   +-- p = 2*bs .. 3*bs-1                  p % block_size
//                       |   +------ p =   bs .. 2*bs-1
//                       +---------- p =    0 .. bs-1
//
// query[r][h] attends to positions 0 .. seq_lens[r]-1 of kv head h / group,
// group = num_heads / num_kv_heads.  One work item is (request, kv head): its
// `group` query heads share every K and V row read, in two passes over the context:
//
//   pass 1 (K):  scores[g][t] = scale * q_g . k_t,                  max_g = max_t scores[g][t]
//   softmax:     scores[g][t] = exp(scores[g][t] - max_g),          sum_g = sum_t scores[g][t]
//   pass 2 (V):  out_g = sum_t scores[g][t] v_t / sum_g
//
// Everything is accumulated in float32, whatever the input dtype.  Slots at or
// beyond seq_len are never read, so an uninitialised (NaN) cache does not matter.

// NOTE: not <torch/extension.h>: it pulls in all of torch's C++ API and triples
// the compile time.  These are all this file uses.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Calls visit(position, row) for the kv_head row of every position < seq_len, in order.
template <typename scalar_t, typename Visit>
inline void for_each_position(const scalar_t* cache, const int32_t* block_table, int64_t seq_len,
                              int64_t block_size, int64_t slot_stride, Visit&& visit) {
  const int64_t block_stride = block_size * slot_stride;
  for (int64_t first = 0, block = 0; first < seq_len; first += block_size, ++block) {
    const scalar_t* block_rows = cache + block_table[block] * block_stride;
    const int64_t num_positions = std::min(block_size, seq_len - first);
    for (int64_t offset = 0; offset < num_positions; ++offset) {
      visit(first + offset, block_rows + offset * slot_stride);
    }
  }
}

// The row as float32: itself for float, else converted into buffer.
template <typename scalar_t>
inline const float* float_row(const scalar_t* src, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buffer[i] = static_cast<float>(src[i]);
    return buffer;
  }
}

template <typename scalar_t>
void decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, float scale) {
  const int64_t num_reqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t slot_stride = num_kv_heads * head_dim;  // one position of the cache
  const scalar_t* queries = query.data_ptr<scalar_t>();
  const scalar_t* keys = key_cache.data_ptr<scalar_t>();
  const scalar_t* values = value_cache.data_ptr<scalar_t>();
  scalar_t* outputs = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();

  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // [group][head_dim] buffers, and scores [group][seq_len], reused across work items.
    std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim);
    std::vector<float> maxes(group), sums(group), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t req = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t seq_len = lens[req];
      const int32_t* table = tables + req * max_blocks;
      // The query heads of one kv head are adjacent: [group][head_dim] from head kv_head * group.
      const int64_t head_offset = (req * num_heads + kv_head * group) * head_dim;
      const scalar_t* q_src = queries + head_offset;
      for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(q_src[i]) * scale;
      scores.resize(seq_len * group);
      std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<float>::infinity());

      for_each_position(keys + kv_head * head_dim, table, seq_len, block_size, slot_stride,
                        [&](int64_t pos, const scalar_t* key) {
        const float* k = float_row(key, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* q_g = q.data() + g * head_dim;
          float dot = 0.f;
          // NOTE: without the pragma the compiler may not reorder the sum, and it stays scalar.
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += q_g[d] * k[d];
          scores[g * seq_len + pos] = dot;
          maxes[g] = std::max(maxes[g], dot);
        }
      });

      for (int64_t g = 0; g < group; ++g) {
        float* scores_g = scores.data() + g * seq_len;
        const float max_g = maxes[g];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t pos = 0; pos < seq_len; ++pos) {
          scores_g[pos] = std::exp(scores_g[pos] - max_g);
          sum += scores_g[pos];
        }
        sums[g] = sum;
      }

      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_position(values + kv_head * head_dim, table, seq_len, block_size, slot_stride,
                        [&](int64_t pos, const scalar_t* value) {
        const float* v = float_row(value, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float weight = scores[g * seq_len + pos];
          float* acc_g = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) acc_g[d] += weight * v[d];
        }
      });

      scalar_t* out_heads = outputs + head_offset;
      for (int64_t g = 0; g < group; ++g) {
        const float inv_sum = 1.f / sums[g];
        for (int64_t d = 0; d < head_dim; ++d) {
          out_heads[g * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv_sum);
        }
      }
    }
  });
}

// Every seq_len must fit its block table, and every block it reads must exist:
// checked up front so that the parallel loop cannot read out of bounds.
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_blocks, int64_t block_size) {
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t req = 0; req < seq_lens.size(0); ++req) {
    const int64_t seq_len = lens[req];
    TORCH_CHECK(seq_len >= 1 && seq_len <= max_blocks * block_size, "seq_lens[", req, "] = ", seq_len,
                " must be in [1, ", max_blocks * block_size, "] (max_blocks * block_size)");
    for (int64_t block = 0; block < (seq_len + block_size - 1) / block_size; ++block) {
      const int64_t block_id = tables[req * max_blocks + block];
      TORCH_CHECK(block_id >= 0 && block_id < num_blocks, "block_tables[", req, "][", block, "] = ",
                  block_id, " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}

}  // namespace

void paged_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3, "query must be [num_reqs, num_heads, head_dim], got ", query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  TORCH_CHECK(out.sizes() == query.sizes(), "out ", out.sizes(), " must have query's shape ", query.sizes());
  const int64_t num_reqs = query.size(0), num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == query.size(2), "query head_dim ", query.size(2), " != cache head_dim ",
              key_cache.size(3));
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(key_cache.size(1) >= 1, "block_size must be at least 1");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_reqs, "block_tables must be [",
              num_reqs, ", max_blocks], got ", block_tables.sizes());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == num_reqs, "seq_lens must be [", num_reqs, "], got ",
              seq_lens.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "query must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(out.scalar_type() == dtype && key_cache.scalar_type() == dtype &&
                  value_cache.scalar_type() == dtype,
              "out, query and the caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  for (const at::Tensor* tensor : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens}) {
    TORCH_CHECK(tensor->device().is_cpu() && tensor->is_contiguous(),
                "all tensors must be contiguous CPU tensors");
  }
  check_block_tables(block_tables, seq_lens, key_cache.size(0), key_cache.size(1));

  AT_DISPATCH_V2(dtype, "paged_decode_attention", AT_WRAP([&] {
    decode_attention<scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens,
                               static_cast<float>(scale));
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention (one query token per request) over a paged KV cache; writes into out.",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
}
