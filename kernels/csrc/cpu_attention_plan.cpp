// Planning of one paged-attention call on CPU (see cpu_attention_plan.h and the
// overview in paged_attention_cpu.cpp).
#include "cpu_attention_plan.h"

#include <algorithm>
#include <unordered_map>

namespace kvserve::cpu {
namespace {

// Cascades only pay when the shared prefix is long and the tile holds a few rows:
// a tile costs about what 4 rows cost alone.
constexpr int64_t kMinCascadeRows = 4;
constexpr int64_t kMinCascadePositions = 32;

void plan_prefill_tiles(const BatchShape& shape, Plan& plan) {
  const int32_t* loc = shape.query_start_loc;
  for (int64_t req = 0; req < shape.num_reqs; ++req) {
    if (plan.decode_rows[req] >= 0) continue;
    const int64_t num_new = loc[req + 1] - loc[req], seq_len = shape.seq_lens[req];
    const int64_t num_cached = seq_len - num_new, num_rows = num_new * shape.group;
    for (int64_t first = 0; first < num_rows; first += kTileRows) {
      Tile tile;
      tile.req = req;
      tile.num_rows = std::min(kTileRows, num_rows - first);
      for (int64_t lane = 0; lane < tile.num_rows; ++lane) {
        const int64_t token = (first + lane) / shape.group;
        tile.tokens[lane] = loc[req] + token;
        tile.heads[lane] = (first + lane) % shape.group;
        tile.lens[lane] = static_cast<float>(num_cached + token + 1);
      }
      tile.num_positions = num_cached + (first + tile.num_rows - 1) / shape.group + 1;
      plan.tiles.push_back(tile);
    }
  }
}

// Decode requests grouped by their first block, taken kTileRows / group at a time.
void plan_cascades(const BatchShape& shape, Plan& plan) {
  const int64_t members_per_tile = kTileRows / shape.group;
  if (members_per_tile < 2) return;
  std::unordered_map<int32_t, size_t> group_of_block;
  std::vector<std::vector<int64_t>> groups;
  for (int64_t req = 0; req < shape.num_reqs; ++req) {
    if (plan.decode_rows[req] < 0 || shape.seq_lens[req] <= shape.block_size) continue;
    const int32_t first_block = shape.tables[req * shape.max_blocks];
    const auto [it, inserted] = group_of_block.try_emplace(first_block, groups.size());
    if (inserted) groups.emplace_back();
    groups[it->second].push_back(req);
  }
  for (const std::vector<int64_t>& members : groups) {
    for (size_t first = 0; first < members.size(); first += members_per_tile) {
      const size_t num_members = std::min<size_t>(members_per_tile, members.size() - first);
      if (num_members < 2 || static_cast<int64_t>(num_members) * shape.group < kMinCascadeRows) continue;
      const int64_t* chunk = members.data() + first;
      // Whole blocks only, and every member keeps at least one position of its own.
      int64_t limit = shape.max_blocks;
      for (size_t m = 0; m < num_members; ++m) {
        limit = std::min<int64_t>(limit, (shape.seq_lens[chunk[m]] - 1) / shape.block_size);
      }
      const int32_t* lead = shape.tables + chunk[0] * shape.max_blocks;
      int64_t num_common = 0;
      for (; num_common < limit; ++num_common) {
        bool shared = true;
        for (size_t m = 1; m < num_members && shared; ++m) {
          shared = shape.tables[chunk[m] * shape.max_blocks + num_common] == lead[num_common];
        }
        if (!shared) break;
      }
      const int64_t prefix_len = num_common * shape.block_size;
      if (prefix_len < kMinCascadePositions) continue;
      Tile tile;
      tile.req = chunk[0];
      tile.num_positions = prefix_len;
      tile.num_rows = static_cast<int64_t>(num_members) * shape.group;
      tile.state_index = plan.num_states++;
      for (int64_t lane = 0; lane < tile.num_rows; ++lane) {
        tile.tokens[lane] = plan.decode_rows[chunk[lane / shape.group]];
        tile.heads[lane] = lane % shape.group;
        tile.lens[lane] = static_cast<float>(prefix_len);
      }
      for (size_t m = 0; m < num_members; ++m) {
        plan.prefixes[chunk[m]] = Prefix{tile.state_index, static_cast<int64_t>(m) * shape.group, prefix_len};
      }
      plan.tiles.push_back(tile);
    }
  }
}

}  // namespace

Plan plan_batch(const BatchShape& shape, bool use_tiles) {
  Plan plan;
  plan.decode_rows.resize(shape.num_reqs);
  plan.prefixes.resize(shape.num_reqs);
  const int32_t* loc = shape.query_start_loc;
  bool has_prefill = false;
  for (int64_t req = 0; req < shape.num_reqs; ++req) {
    const bool decode = loc == nullptr || loc[req + 1] - loc[req] == 1;
    plan.decode_rows[req] = decode ? (loc == nullptr ? req : loc[req]) : -1;
    has_prefill = has_prefill || !decode;
  }
  if (use_tiles) {
    plan_prefill_tiles(shape, plan);
    plan_cascades(shape, plan);
  }
  plan.prefill_done = use_tiles || !has_prefill;
  return plan;
}

}  // namespace kvserve::cpu
