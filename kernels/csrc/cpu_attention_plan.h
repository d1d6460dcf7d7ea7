// The plan of one paged-attention call on CPU: which rows go through row tiles
// (prefill chunks, cascades over shared prefixes) and which through the
// per-request decode path.  Plain C++: no ATen, no vector code.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_attention.h"

namespace kvserve::cpu {

// Up to kTileRows (token, query head) rows of one kv head, over one request's block table.
struct Tile {
  int64_t req = 0;            // whose block table the positions are read through
  int64_t num_positions = 0;  // positions [0, num_positions): what its longest row sees
  int64_t num_rows = 0;
  int64_t tokens[kTileRows];  // row of query and out
  int64_t heads[kTileRows];   // query head within the kv head's group
  float lens[kTileRows];      // positions each row sees
  int64_t state_index = -1;   // -1: the rows end here (out is written); else a cascade prefix
};

// A decode request's shared prefix: positions [0, len) in lanes [lane, lane + group) of a tile.
struct Prefix {
  int64_t state_index = -1;
  int64_t lane = 0;
  int64_t len = 0;
};

struct Plan {
  std::vector<int64_t> decode_rows;  // per request: its token, or -1 for a prefill chunk
  std::vector<Prefix> prefixes;      // per request
  std::vector<Tile> tiles;
  int64_t num_states = 0;            // cascade tiles, whose rows leave a softmax state
  bool prefill_done = false;         // whether the rows of prefill chunks are computed
};

// The batch as the planner sees it; inputs already validated (every request has at
// least one new token and no more than its context).
struct BatchShape {
  int64_t num_reqs, num_tokens, group, block_size, max_blocks;
  const int32_t* query_start_loc;  // nullptr: one token per request
  const int32_t* seq_lens;
  const int32_t* tables;
};

// Decode rows always; with use_tiles (AVX2 and above) also prefill tiles and cascades.
Plan plan_batch(const BatchShape& shape, bool use_tiles);

}  // namespace kvserve::cpu
