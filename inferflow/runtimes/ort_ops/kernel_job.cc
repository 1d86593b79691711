// inferflow.PagedAttention's one call, planned: the work items, the inputs' checks, fp16
// conversions. Not a translation unit of its own: paged_attention.cc includes it once, inside
// namespace inferflow::(anonymous), before the kernels that read the Job.

// ---- fp16 <-> fp32, round to nearest even (F. Giesen's conversions) -------------------------

inline float f16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h & 0x7fff) << 13;
  const uint32_t exp = u & (0x7c00u << 13);
  u += (127 - 15) << 23;
  float f;
  if (exp == (0x7c00u << 13)) {  // inf / nan
    u += (128 - 16) << 23;
    std::memcpy(&f, &u, 4);
  } else if (exp == 0) {  // zero / subnormal
    u += 1 << 23;
    std::memcpy(&f, &u, 4);
    f -= 6.103515625e-05f;  // 2^-14
  } else {
    std::memcpy(&f, &u, 4);
  }
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= static_cast<uint32_t>(h & 0x8000) << 16;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_f16(float value) {
  uint32_t x;
  std::memcpy(&x, &value, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffff;
  uint32_t o;
  if (x >= 0x47800000) {  // >= 65536 (after rounding: inf), inf or nan
    o = x > 0x7f800000 ? 0x7e00 : 0x7c00;
  } else if (x < 0x38800000) {  // below 2^-14: subnormal or zero, rounded by a float add
    float f;
    std::memcpy(&f, &x, 4);
    f += 0.5f;
    std::memcpy(&o, &f, 4);
    o -= 0x3f000000;
  } else {
    const uint32_t odd = (x >> 13) & 1;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff;
    x += odd;
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | sign);
}

// ---- one call's work --------------------------------------------------------------------------

// Queries q0 .. q1 - 1 (indices within row b's tokens) of KV head h, with their G query heads;
// a split (decode, few items) covers keys k0 .. k1 - 1 of their range and writes partial `part`.
struct Item {
  int32_t b, h, q0, q1;
  int64_t cost;  // ~ rows x keys, for longest-first order
  int32_t k0 = 0, k1 = -1, part = -1;
};

// The parts first .. first + count - 1 of one split item, merged into its output.
struct Split {
  Item item;
  int32_t first, count;
};

struct Job {
  int64_t N, B, Hq, Hkv, D, NB, block_size, table_width, rot, window;
  int G;
  float scale, softcap;
  int64_t qkv_stride;  // (Hq + 2 Hkv) D
  const void* qkv;     // T (N, qkv_stride)
  void* key_out;       // TKV (NB, Hkv, bs, D): the caches written and read (outputs 1 and 2)
  void* value_out;
  void* out;  // T (N, Hq D)
  const int64_t* positions;
  const int64_t* slot_mapping;
  const int32_t* block_tables;  // (B, table_width)
  const int32_t* query_start;   // (B + 1,)
  const float* cos;             // (P, rot / 2)
  const float* sin;
  std::vector<int64_t> row_start;  // (B,) position of row b's first query: seq_len - q_len
  std::vector<Item> items;
  std::vector<Split> splits;
  float* partial = nullptr;  // (parts, part_stride): split items' O, row maxima, row sums
  size_t part_stride = 0;
  std::vector<float> partial_store;
  int64_t write_batches = 1;
};

// What one instruction set offers: the two ParallelFor callbacks and its tiling.
struct Kernels {
  void (*write)(void*, size_t);   // write_batch: token batch i
  void (*attend)(void*, size_t);  // attend: items[i]
  void (*merge)(void*, size_t);   // merge_split: splits[i]
  int lanes, small_rows, score_panel;
};

// ---- checks -----------------------------------------------------------------------------------

void check(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("PagedAttention: ") + what);
}

// `what` builds the message only when the check fails (they run per token)
template <class Message>
void check(bool ok, const Message& what) {
  if (!ok) throw std::invalid_argument("PagedAttention: " + what());
}

bool is_vector(const std::vector<int64_t>& shape, int64_t length) {
  return shape.size() == 1 && shape[0] == length;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// Inputs that would make the kernels read or write out of bounds are refused.
void validate_rows(Job& J, const int32_t* seq_lens, int64_t table_len) {
  const int64_t slots = J.NB * J.block_size;
  for (int64_t n = 0; n < J.N; ++n) {
    check(J.slot_mapping[n] >= 0 && J.slot_mapping[n] < slots, [&] {
      return "slot_mapping[" + std::to_string(n) + "] = " + std::to_string(J.slot_mapping[n]) +
             " is outside the cache";
    });
    check(J.rot == 0 || (J.positions[n] >= 0 && J.positions[n] < table_len),
          [&] { return "positions[" + std::to_string(n) + "] is outside the rotary tables"; });
  }
  check(J.query_start[0] == 0 && J.query_start[J.B] == J.N, "query_start must run from 0 to the token count");
  J.row_start.resize(static_cast<size_t>(J.B));
  for (int64_t b = 0; b < J.B; ++b) {
    const int64_t q_len = J.query_start[b + 1] - J.query_start[b];
    check(q_len >= 0, "query_start must not decrease");
    check(seq_lens[b] >= q_len, [&] { return "row " + std::to_string(b) + ": seq_len below its query count"; });
    J.row_start[b] = seq_lens[b] - q_len;
    if (q_len == 0) continue;
    const int64_t last = seq_lens[b] - 1;
    const int64_t lo = J.window > 0 ? std::max<int64_t>(0, J.row_start[b] - J.window + 1) : 0;
    check(last / J.block_size < J.table_width, [&] {
      return "row " + std::to_string(b) + ": the block table is too narrow for " +
             std::to_string(seq_lens[b]) + " positions";
    });
    const int32_t* table = J.block_tables + b * J.table_width;
    for (int64_t i = lo / J.block_size; i <= last / J.block_size; ++i)
      check(table[i] >= 0 && table[i] < J.NB, [&] {
        return "row " + std::to_string(b) + ": block id " + std::to_string(table[i]) + " is outside the cache";
      });
  }
}

// ---- work items ---------------------------------------------------------------------------------

// Work items: per row and KV head, its queries whole (few rows: the small path) or in tiles
// of about score_panel vectors of rows; longest first, so the pool's dynamic hand-out ends even.
void make_items(Job& J, const Kernels& k) {
  J.items.clear();
  const int tile = std::max(1, k.score_panel * k.lanes / J.G);
  for (int64_t b = 0; b < J.B; ++b) {
    const int q_len = J.query_start[b + 1] - J.query_start[b];
    if (q_len == 0) continue;
    const int step = q_len * J.G <= k.small_rows ? q_len : tile;
    for (int q0 = 0; q0 < q_len; q0 += step) {
      const int q1 = std::min(q_len, q0 + step);
      const int64_t first = J.row_start[b] + q0, last = J.row_start[b] + q1 - 1;
      const int64_t lo = J.window > 0 ? std::max<int64_t>(0, first - J.window + 1) : 0;
      const int64_t cost = static_cast<int64_t>(q1 - q0) * J.G * (last - lo + 1) + 64;
      for (int32_t h = 0; h < J.Hkv; ++h)
        J.items.push_back(Item{static_cast<int32_t>(b), h, q0, q1, cost});
    }
  }
  std::stable_sort(J.items.begin(), J.items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
}

// CPUs this process may run on (the intra-op pool is at most that large; the C API does not say
// how large it is).
int64_t usable_cpus() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// Fewer small (decode) items than twice the CPUs, e.g. one row on a big machine: split each
// one's keys so that every thread has work (flash-decoding), parts of >= kSplitKeys keys.
constexpr int64_t kSplitKeys = 256;

void split_items(Job& J, const Kernels& k) {
  J.splits.clear();
  static const int64_t kWantItems = 2 * usable_cpus();
  const int64_t n = static_cast<int64_t>(J.items.size());
  if (n >= kWantItems) return;
  std::vector<Item> out;
  int32_t parts = 0;
  for (const Item& it : J.items) {
    const int64_t keys = it.cost - 64;  // (q1 - q0) G x keys + 64, below
    const int64_t range = keys / ((it.q1 - it.q0) * J.G);
    const int64_t want = std::min((kWantItems + n - 1) / n, range / kSplitKeys);
    if ((it.q1 - it.q0) * J.G > k.small_rows || want < 2) {
      out.push_back(it);
      continue;
    }
    J.splits.push_back(Split{it, parts, static_cast<int32_t>(want)});
    for (int64_t i = 0; i < want; ++i) {
      Item part = it;
      part.k0 = static_cast<int32_t>(range * i / want);
      part.k1 = static_cast<int32_t>(range * (i + 1) / want);
      part.part = parts++;
      part.cost = it.cost / want;
      out.push_back(part);
    }
  }
  if (J.splits.empty()) return;
  J.part_stride = static_cast<size_t>(k.small_rows) * (J.D + 2);
  J.partial_store.resize(static_cast<size_t>(parts) * J.part_stride);
  J.partial = J.partial_store.data();
  J.items = std::move(out);
  std::stable_sort(J.items.begin(), J.items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
}
