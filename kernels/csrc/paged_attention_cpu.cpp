// Paged attention on CPU: K/V read in place from the paged cache (no gather into
// a padded copy), rows of query and out read and written in place.
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
// Request r has tokens query_start_loc[r] .. query_start_loc[r+1]-1 (rows of query
// and out, which may be views of a fused projection: heads and dims dense); token j
// of its n new ones attends to positions 0 .. seq_lens[r]-n+j with query head h
// reading kv head h / group, group = num_heads / num_kv_heads.
//
// Three kinds of work, planned once per call (`plan_batch`, cpu_attention_plan.cpp):
//
// * Decode rows (requests with one new token), one work item per (request, kv
//   head): its `group` query heads share every K and V row read, in two passes
//   over the context with the per-request row operations (`RowOps`, AVX2 or
//   portable):
//
//     pass 1 (K):  scores[g][t] = scale * q_g . k_t,            max_g = max_t scores[g][t]
//     softmax:     scores[g][t] = exp(scores[g][t] - max_g),    sum_g = sum_t scores[g][t]
//     pass 2 (V):  out_g = sum_t scores[g][t] v_t / sum_g
//
// * Prefill chunks (more than one new token), with AVX2 or AVX-512: row tiles of
//   16 (token, query head) rows in vector lanes, causal per row (`attend_tile_*`).
//   On a CPU without AVX2 these rows are left to the caller, and paged_attention
//   returns false.
//
// * Cascades, with AVX2 or AVX-512: decode requests whose block tables start with the
//   same blocks (a cached prompt prefix) attend to that prefix together, in one
//   row tile of up to 16 rows, which leaves (max, sum, acc) per row; each request
//   then attends to the rest of its context alone and merges the two softmax
//   states.  The prefix's K/V is then read once for all of them:
//
//     request a:  [ shared prefix blocks | a's own blocks ]
//     request b:  [ shared prefix blocks | b's own blocks ]      tile: rows of a and b
//                 <---- one row tile ---> <- per request ->
//
// Work items read a block at a time, as float32 rows: in place for a float32 cache,
// else converted into a buffer first.  Everything is accumulated in float32,
// whatever the input dtype.  Slots at or beyond a row's context are never read,
// so an uninitialised (NaN) cache does not matter.  The result of a row does not
// depend on the number of threads.
//
// NOTE: compiled without -march flags (the build directory may be shared by
// machines with different CPUs): vector code carries target attributes and runs
// only when the CPU reports the instructions (see cpu_vector_math.h).

// NOTE: not <torch/extension.h>: it pulls in all of torch's C++ API and triples
// the compile time.  These are all this file uses.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "check_message.h"
#include "cpu_attention.h"
#include "cpu_attention_plan.h"

using kvserve::check::require;

namespace {

using kvserve::cpu::BatchShape;
using kvserve::cpu::Capability;
using kvserve::cpu::kTileRows;
using kvserve::cpu::Plan;
using kvserve::cpu::Prefix;
using kvserve::cpu::Tile;

std::atomic<int> g_capability{-1};  // -1: not yet detected

Capability capability() {
  int value = g_capability.load(std::memory_order_relaxed);
  if (value < 0) {
    value = static_cast<int>(kvserve::cpu::detect_capability());
    g_capability.store(value, std::memory_order_relaxed);
  }
  return static_cast<Capability>(value);
}

const char* capability_name(Capability value) {
  switch (value) {
    case Capability::kAvx512:
      return "avx512";
    case Capability::kAvx2:
      return "avx2";
    default:
      return "portable";
  }
}

// ---- execution -------------------------------------------------------------------------

template <typename scalar_t>
struct Batch {
  const scalar_t* queries;
  int64_t query_stride;
  scalar_t* outputs;
  int64_t out_stride;
  const scalar_t* keys;
  const scalar_t* values;
  const int32_t* tables;
  const int32_t* seq_lens;
  int64_t max_blocks, num_kv_heads, group, head_dim, block_size;
  float scale;

  int64_t slot_stride() const { return num_kv_heads * head_dim; }  // one position of the cache
  // Offset of kv_head's row at the first slot of the block-th block of req.
  int64_t block_offset(int64_t req, int64_t block, int64_t kv_head) const {
    return tables[req * max_blocks + block] * block_size * slot_stride() + kv_head * head_dim;
  }
  // Offset of query head (kv_head, g) in a row of query or out.
  int64_t head_offset(int64_t kv_head, int64_t g) const { return (kv_head * group + g) * head_dim; }
};

// Rows [0, count) of one block as float32: in place for float, else converted into buffer
// (which then holds them `head_dim` apart).  Returns the rows and their stride.
template <typename scalar_t>
inline std::pair<const float*, int64_t> float_rows(const scalar_t* src, int64_t stride, int64_t count,
                                                   int64_t head_dim, float* buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return {src, stride};
  } else {
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t d = 0; d < head_dim; ++d) buffer[i * head_dim + d] = static_cast<float>(src[i * stride + d]);
    }
    return {buffer, head_dim};
  }
}

// Softmax state of one row of a cascade prefix: max, sum, then acc[head_dim].
inline float* prefix_state(std::vector<float>& states, int64_t state_index, int64_t kv_head, int64_t lane,
                           int64_t num_kv_heads, int64_t head_dim) {
  return states.data() + ((state_index * num_kv_heads + kv_head) * kTileRows + lane) * (head_dim + 2);
}

template <typename scalar_t>
void run_tiles(const Batch<scalar_t>& batch, const Plan& plan, std::vector<float>& states,
               kvserve::cpu::AttendTile attend_tile) {
  const int64_t head_dim = batch.head_dim, num_kv_heads = batch.num_kv_heads;
  constexpr bool kConvert = !std::is_same_v<scalar_t, float>;
  at::parallel_for(0, static_cast<int64_t>(plan.tiles.size()) * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries_t(head_dim * kTileRows), acc(head_dim * kTileRows);
    std::vector<float> key_buffer(kConvert ? batch.block_size * head_dim : 0), value_buffer(key_buffer.size());
    float lens[kTileRows], max[kTileRows], sum[kTileRows];
    for (int64_t item = begin; item < end; ++item) {
      const Tile& tile = plan.tiles[item / num_kv_heads];
      const int64_t kv_head = item % num_kv_heads;
      // Lanes past num_rows repeat row 0; their results are dropped.
      for (int64_t lane = 0; lane < kTileRows; ++lane) {
        const int64_t row = lane < tile.num_rows ? lane : 0;
        const scalar_t* q = batch.queries + tile.tokens[row] * batch.query_stride +
                            batch.head_offset(kv_head, tile.heads[row]);
        for (int64_t d = 0; d < head_dim; ++d) queries_t[d * kTileRows + lane] = static_cast<float>(q[d]) * batch.scale;
        lens[lane] = tile.lens[row];
      }
      std::fill_n(max, kTileRows, -FLT_MAX);
      std::fill_n(sum, kTileRows, 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t first = 0, block = 0; first < tile.num_positions; first += batch.block_size, ++block) {
        const int64_t count = std::min(batch.block_size, tile.num_positions - first);
        const int64_t offset = batch.block_offset(tile.req, block, kv_head);
        const auto [k, k_stride] = float_rows(batch.keys + offset, batch.slot_stride(), count, head_dim, key_buffer.data());
        const auto [v, v_stride] = float_rows(batch.values + offset, batch.slot_stride(), count, head_dim, value_buffer.data());
        attend_tile(queries_t.data(), lens, first, k, k_stride, v, v_stride, count, head_dim, max, sum, acc.data());
      }
      for (int64_t lane = 0; lane < tile.num_rows; ++lane) {
        if (tile.state_index < 0) {
          scalar_t* out = batch.outputs + tile.tokens[lane] * batch.out_stride +
                          batch.head_offset(kv_head, tile.heads[lane]);
          const float inv_sum = 1.f / sum[lane];
          for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<scalar_t>(acc[d * kTileRows + lane] * inv_sum);
        } else {
          float* state = prefix_state(states, tile.state_index, kv_head, lane, num_kv_heads, head_dim);
          state[0] = max[lane];
          state[1] = sum[lane];
          for (int64_t d = 0; d < head_dim; ++d) state[2 + d] = acc[d * kTileRows + lane];
        }
      }
    }
  });
}

template <typename scalar_t>
void run_decodes(const Batch<scalar_t>& batch, const Plan& plan, std::vector<float>& states,
                 const kvserve::cpu::RowOps& ops) {
  const int64_t head_dim = batch.head_dim, group = batch.group, num_kv_heads = batch.num_kv_heads;
  const int64_t block_size = batch.block_size, num_reqs = static_cast<int64_t>(plan.decode_rows.size());
  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // [group][head_dim] buffers, scores [group][positions] and one converted block, reused
    // across work items.
    std::vector<float> q(group * head_dim), acc(group * head_dim), maxes(group), sums(group), scores;
    std::vector<float> block_buffer(std::is_same_v<scalar_t, float> ? 0 : block_size * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t req = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t row = plan.decode_rows[req];
      if (row < 0) continue;  // a prefill chunk
      const Prefix& prefix = plan.prefixes[req];
      // Positions [start, seq_len) here; [0, start) were a cascade's (start is whole blocks).
      const int64_t start = prefix.len, num_positions = batch.seq_lens[req] - start;
      const scalar_t* q_src = batch.queries + row * batch.query_stride + batch.head_offset(kv_head, 0);
      for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(q_src[i]) * batch.scale;
      scores.resize(num_positions * group);

      for (int64_t first = 0, block = start / block_size; first < num_positions; first += block_size, ++block) {
        const int64_t count = std::min(block_size, num_positions - first);
        const auto [k, k_stride] = float_rows(batch.keys + batch.block_offset(req, block, kv_head),
                                              batch.slot_stride(), count, head_dim, block_buffer.data());
        ops.scores(q.data(), group, head_dim, k, k_stride, count, scores.data() + first, num_positions);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* scores_g = scores.data() + g * num_positions;
        maxes[g] = ops.max(scores_g, num_positions);
        sums[g] = ops.exp_sum(scores_g, num_positions, maxes[g]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t first = 0, block = start / block_size; first < num_positions; first += block_size, ++block) {
        const int64_t count = std::min(block_size, num_positions - first);
        const auto [v, v_stride] = float_rows(batch.values + batch.block_offset(req, block, kv_head),
                                              batch.slot_stride(), count, head_dim, block_buffer.data());
        ops.accumulate(scores.data() + first, num_positions, group, head_dim, v, v_stride, count, acc.data());
      }

      scalar_t* out = batch.outputs + row * batch.out_stride + batch.head_offset(kv_head, 0);
      for (int64_t g = 0; g < group; ++g) {
        float* acc_g = acc.data() + g * head_dim;
        float total = sums[g];
        if (prefix.state_index >= 0) {  // merge with the prefix: both rescaled to the larger max
          const float* state =
              prefix_state(states, prefix.state_index, kv_head, prefix.lane + g, num_kv_heads, head_dim);
          const float max = std::max(state[0], maxes[g]);
          const float prefix_scale = std::exp(state[0] - max), own_scale = std::exp(maxes[g] - max);
          total = state[1] * prefix_scale + sums[g] * own_scale;
          for (int64_t d = 0; d < head_dim; ++d) acc_g[d] = state[2 + d] * prefix_scale + acc_g[d] * own_scale;
        }
        const float inv_sum = 1.f / total;
        for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = static_cast<scalar_t>(acc_g[d] * inv_sum);
      }
    }
  });
}

// `level`: the capability the plan was made for (read once per call).
template <typename scalar_t>
void run_plan(const Batch<scalar_t>& batch, const Plan& plan, Capability level) {
  std::vector<float> states(plan.num_states * batch.num_kv_heads * kTileRows * (batch.head_dim + 2));
  if (!plan.tiles.empty()) {
    run_tiles(batch, plan, states,
              level >= Capability::kAvx512 ? kvserve::cpu::attend_tile_avx512 : kvserve::cpu::attend_tile_avx2);
  }
  run_decodes(batch, plan, states, kvserve::cpu::row_ops(level, batch.head_dim));
}

// ---- checks ----------------------------------------------------------------------------

// Every seq_len must fit its block table, and every block it reads must exist:
// checked up front so that the parallel loops cannot read out of bounds.
void check_block_tables(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t num_blocks, int64_t block_size) {
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t req = 0; req < seq_lens.size(0); ++req) {
    const int64_t seq_len = lens[req];
    require(seq_len >= 1 && seq_len <= max_blocks * block_size, "seq_lens[", req, "] = ", seq_len,
            " must be in [1, ", max_blocks * block_size, "] (max_blocks * block_size)");
    for (int64_t block = 0; block < (seq_len + block_size - 1) / block_size; ++block) {
      const int64_t block_id = tables[req * max_blocks + block];
      require(block_id >= 0 && block_id < num_blocks, "block_tables[", req, "][", block, "] = ",
              block_id, " is not a block of the cache (", num_blocks, " blocks)");
    }
  }
}

void check_query_start_loc(const at::Tensor& starts, const at::Tensor& seq_lens, int64_t num_tokens) {
  const int64_t num_reqs = seq_lens.size(0);
  require(starts.device().is_cpu() && starts.is_contiguous() && starts.scalar_type() == at::kInt &&
              starts.dim() == 1 && starts.size(0) == num_reqs + 1,
          "query_start_loc must be a contiguous int32 CPU tensor of ", num_reqs + 1, " entries");
  const int32_t* loc = starts.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  require(loc[0] == 0 && loc[num_reqs] == num_tokens, "query_start_loc must run from 0 to ", num_tokens,
          " (query's rows)");
  for (int64_t req = 0; req < num_reqs; ++req) {
    require(loc[req + 1] > loc[req], "query_start_loc must be increasing, got ", loc[req], " then ",
            loc[req + 1], " at ", req);
    const int64_t num_new = loc[req + 1] - loc[req], seq_len = lens[req];
    require(num_new <= seq_len, "request ", req, " has ", num_new, " new tokens but seq_lens[", req, "] = ",
            seq_len);
  }
}

// Heads and dims dense, any stride between rows: a view of a fused projection qualifies.  A dimension
// of size 1 may have any stride (torch calls such a tensor contiguous: one head transposed into place).
bool rows_are_dense(const at::Tensor& tensor) {
  return (tensor.size(2) == 1 || tensor.stride(2) == 1) &&
         (tensor.size(1) == 1 || tensor.stride(1) == tensor.size(2)) && tensor.stride(0) >= 0;
}

}  // namespace

bool paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     double scale, const std::optional<at::Tensor>& query_start_loc) {
  require(query.dim() == 3, "query must be [num_tokens, num_heads, head_dim], got ", query.sizes());
  require(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
          "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got ",
          key_cache.sizes(), " and ", value_cache.sizes());
  require(out.sizes() == query.sizes(), "out ", out.sizes(), " must have query's shape ", query.sizes());
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  require(key_cache.size(3) == query.size(2), "query head_dim ", query.size(2), " != cache head_dim ",
          key_cache.size(3));
  require(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "num_heads ", num_heads,
          " is not a multiple of num_kv_heads ", num_kv_heads);
  require(key_cache.size(1) >= 1, "block_size must be at least 1");
  require(seq_lens.dim() == 1, "seq_lens must be [num_reqs], got ", seq_lens.sizes());
  const int64_t num_reqs = seq_lens.size(0);
  require(block_tables.dim() == 2 && block_tables.size(0) == num_reqs, "block_tables must be [",
          num_reqs, ", max_blocks], got ", block_tables.sizes());
  const auto dtype = query.scalar_type();
  require(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
          "query must be float32, bfloat16 or float16, got ", dtype);
  require(out.scalar_type() == dtype && key_cache.scalar_type() == dtype &&
              value_cache.scalar_type() == dtype,
          "out, query and the caches must share one dtype");
  require(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
          "block_tables and seq_lens must be int32");
  for (const at::Tensor* tensor : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens}) {
    require(tensor->device().is_cpu(), "all tensors must be CPU tensors");
  }
  for (const at::Tensor* tensor : {&key_cache, &value_cache, &block_tables, &seq_lens}) {
    require(tensor->is_contiguous(), "the caches, block_tables and seq_lens must be contiguous");
  }
  require(rows_are_dense(query) && rows_are_dense(out),
          "query and out must have contiguous heads and dims (any stride between rows)");
  const int64_t num_tokens = query.size(0);
  if (query_start_loc.has_value()) {
    check_query_start_loc(*query_start_loc, seq_lens, num_tokens);
  } else {
    require(num_tokens == num_reqs, "without query_start_loc, query must have one row per request (",
            num_reqs, "), got ", num_tokens);
  }
  check_block_tables(block_tables, seq_lens, key_cache.size(0), key_cache.size(1));

  const int64_t group = num_heads / num_kv_heads, block_size = key_cache.size(1);
  const BatchShape shape{num_reqs,
                         num_tokens,
                         group,
                         block_size,
                         block_tables.size(1),
                         query_start_loc.has_value() ? query_start_loc->data_ptr<int32_t>() : nullptr,
                         seq_lens.data_ptr<int32_t>(),
                         block_tables.data_ptr<int32_t>()};
  const Capability level = capability();
  const Plan plan = kvserve::cpu::plan_batch(shape, level >= Capability::kAvx2);

  AT_DISPATCH_V2(dtype, "paged_attention", AT_WRAP([&] {
    const Batch<scalar_t> batch{query.data_ptr<scalar_t>(), query.stride(0), out.data_ptr<scalar_t>(),
                                out.stride(0), key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                                shape.tables, shape.seq_lens, shape.max_blocks, num_kv_heads, group,
                                query.size(2), block_size, static_cast<float>(scale)};
    run_plan(batch, plan, level);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return plan.prefill_done;
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  require(key.dim() == 3 && key.sizes() == value.sizes(), "key and value must both be [num_tokens, "
          "num_kv_heads, head_dim], got ", key.sizes(), " and ", value.sizes());
  require(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
              key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2),
          "key_cache and value_cache must both be [num_blocks, block_size, ", key.size(1), ", ",
          key.size(2), "], got ", key_cache.sizes(), " and ", value_cache.sizes());
  require(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
              slot_mapping.scalar_type() == at::kLong,
          "slot_mapping must be int64 [", key.size(0), "], got ", slot_mapping.sizes());
  const auto dtype = key_cache.scalar_type();
  require(key.scalar_type() == dtype && value.scalar_type() == dtype && value_cache.scalar_type() == dtype,
          "key, value and the caches must share one dtype");
  for (const at::Tensor* tensor : {&key, &value, &key_cache, &value_cache, &slot_mapping}) {
    require(tensor->device().is_cpu(), "all tensors must be CPU tensors");
  }
  require(key_cache.is_contiguous() && value_cache.is_contiguous() && slot_mapping.is_contiguous(),
          "the caches and slot_mapping must be contiguous");
  require(rows_are_dense(key) && rows_are_dense(value),
          "key and value must have contiguous heads and dims (any stride between rows)");
  const int64_t num_tokens = key.size(0), num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t token = 0; token < num_tokens; ++token) {
    require(slots[token] >= 0 && slots[token] < num_slots, "slot_mapping[", token, "] = ", slots[token],
            " is not a slot of the cache (", num_slots, " slots)");
  }
  const auto* key_src = static_cast<const char*>(key.data_ptr());
  const auto* value_src = static_cast<const char*>(value.data_ptr());
  auto* key_dst = static_cast<char*>(key_cache.data_ptr());
  auto* value_dst = static_cast<char*>(value_cache.data_ptr());
  const int64_t key_stride = key.stride(0) * key.element_size();
  const int64_t value_stride = value.stride(0) * value.element_size();
  for (int64_t token = 0; token < num_tokens; ++token) {
    std::memcpy(key_dst + slots[token] * row_bytes, key_src + token * key_stride, row_bytes);
    std::memcpy(value_dst + slots[token] * row_bytes, value_src + token * value_stride, row_bytes);
  }
}

std::string cpu_capability() { return capability_name(capability()); }

void set_cpu_capability(const std::string& name) {
  const Capability detected = kvserve::cpu::detect_capability();
  for (const Capability value : {Capability::kPortable, Capability::kAvx2, Capability::kAvx512}) {
    if (name == capability_name(value)) {
      require(value <= detected, "this CPU supports up to ", capability_name(detected), ", not ", name);
      g_capability.store(static_cast<int>(value), std::memory_order_relaxed);
      return;
    }
  }
  kvserve::check::fail("unknown CPU capability '", name, "' (portable, avx2 or avx512)");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Attention of every row over a paged KV cache, written into out. Returns whether the rows of "
        "prefill chunks (requests with several new tokens) were computed too; without AVX2 only the "
        "decode rows are.",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("query_start_loc") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv_cache", &write_kv_cache,
        "Copy token t's key and value rows into cache slot slot_mapping[t].", py::arg("key"), py::arg("value"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::call_guard<py::gil_scoped_release>());
  m.def("cpu_capability", &cpu_capability, "The instruction set the kernels use: avx512, avx2 or portable.");
  m.def("set_cpu_capability", &set_cpu_capability,
        "Use at most this instruction set (portable, avx2 or avx512; not above what the CPU has).",
        py::arg("name"));
}
