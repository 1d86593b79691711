// inferflow.PagedAttention: one decoder layer's attention over a paged KV cache, as an ONNX
// Runtime custom op for the CPU provider (lite custom op API; no link against libonnxruntime:
// the runtime's API table comes through RegisterCustomOps). The interface (inputs, outputs,
// attributes, semantics) is documented in inferflow/runtimes/ort_ops/__init__.py.
//
// One call: (1) the caches are copied to the outputs unless the runner bound them to the same
// memory (then the op works in place); (2) every token's k is rotated and its k and v written to
// its slot; (3) every query token attends over keys 0 .. p of its row (window-limited) through
// the row's block table. (2) and (3) each run on ONNX Runtime's intra-op pool (ParallelFor):
// (2) over token batches, (3) over work items (row, KV head, query tile), longest first.
//
// Files: kernel_job.cc (the call's plan: work items, checks), included once; kernel_vector.cc,
// kernel_small.cc (write phase, decode path) and kernel_tile.cc (prefill path), included three
// times below (AVX-512, AVX2+FMA+F16C, portable) and chosen at run time from the CPU
// ($INFERFLOW_ORT_OP_ISA = avx512 | avx2 | portable forces a lower one, for tests).
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT
#include "onnxruntime_lite_custom_op.h"

namespace inferflow {
namespace {
#include "kernel_job.cc"
}  // namespace
}  // namespace inferflow

// ---- the kernels, once per instruction set ----------------------------------------------------

#if defined(__x86_64__) && defined(__GNUC__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#endif
namespace inferflow {
namespace {
namespace isa_avx512 {
#define IF_ISA 2
#define IF_W 16
#include "kernel_vector.cc"
#include "kernel_small.cc"
#include "kernel_tile.cc"
#undef IF_ISA
#undef IF_W
}  // namespace isa_avx512
}  // namespace
}  // namespace inferflow
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace inferflow {
namespace {
namespace isa_avx2 {
#define IF_ISA 1
#define IF_W 8
#include "kernel_vector.cc"
#include "kernel_small.cc"
#include "kernel_tile.cc"
#undef IF_ISA
#undef IF_W
}  // namespace isa_avx2
}  // namespace
}  // namespace inferflow
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#define IF_HAVE_X86_PATHS 1
#endif

namespace inferflow {
namespace {
namespace isa_portable {
#define IF_ISA 0
#define IF_W 4
#include "kernel_vector.cc"
#include "kernel_small.cc"
#include "kernel_tile.cc"
#undef IF_ISA
#undef IF_W
}  // namespace isa_portable

enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "portable";
}

// The best set this CPU runs, lowered by $INFERFLOW_ORT_OP_ISA.
Isa best_isa() {
  Isa isa = Isa::portable;
#ifdef IF_HAVE_X86_PATHS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = Isa::avx2;
  if (isa == Isa::avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    isa = Isa::avx512;
#endif
  if (const char* env = std::getenv("INFERFLOW_ORT_OP_ISA")) {
    const std::string want(env);
    if (want == "portable") isa = Isa::portable;
    if (want == "avx2" && isa == Isa::avx512) isa = Isa::avx2;
  }
  return isa;
}

// The kernels for this call: the best set whose vector width divides D.
Kernels select_kernels(Isa isa, int64_t D, bool t_half, bool kv_half) {
#ifdef IF_HAVE_X86_PATHS
  if (isa == Isa::avx512 && D % 16 == 0) return isa_avx512::kernels(t_half, kv_half);
  if (isa >= Isa::avx2 && D % 8 == 0) return isa_avx2::kernels(t_half, kv_half);
#else
  (void)isa;
#endif
  return isa_portable::kernels(t_half, kv_half);
}

// ---- the op -----------------------------------------------------------------------------------

struct Attributes {
  int64_t num_heads = 0, kv_num_heads = 0, window = 0, rotary_dim = 0;
  float scale = 0.f, softcap = 0.f;
};

int64_t attr_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t fallback,
                 bool required) {
  int64_t value = fallback;
  OrtStatus* status = api->KernelInfoGetAttribute_int64(info, name, &value);
  if (status != nullptr) {
    api->ReleaseStatus(status);
    if (required) throw std::invalid_argument(std::string("PagedAttention: attribute ") + name + " is required");
    return fallback;
  }
  return value;
}

// A float attribute, 0 when absent; an integer one (scale=1 written by a graph builder) is read too.
float attr_float(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  float value = 0.f;
  OrtStatus* status = api->KernelInfoGetAttribute_float(info, name, &value);
  if (status == nullptr) return value;
  api->ReleaseStatus(status);
  return static_cast<float>(attr_int(api, info, name, 0, false));
}

// ParallelFor over `total` indices (or inline when there is one).
void parallel(OrtKernelContext* ctx, void (*fn)(void*, size_t), size_t total, size_t batches, void* job) {
  if (total == 1) {
    fn(job, 0);
    return;
  }
  Ort::KernelContext(ctx).ParallelFor(fn, total, batches, job);
}

struct CopyJob {
  const char* src;
  char* dst;
  size_t bytes, per;
};

void copy_part(void* job, size_t i) {
  const CopyJob& c = *static_cast<const CopyJob*>(job);
  const size_t at = i * c.per;
  if (at < c.bytes) std::memcpy(c.dst + at, c.src + at, std::min(c.per, c.bytes - at));
}

void copy_cache(OrtKernelContext* ctx, const void* src, void* dst, size_t bytes) {
  if (src == dst || bytes == 0) return;
  CopyJob job{static_cast<const char*>(src), static_cast<char*>(dst), bytes, size_t{1} << 22};
  parallel(ctx, &copy_part, (bytes + job.per - 1) / job.per, 0, &job);
}

template <class T, class TKV>
struct PagedAttention {
  Attributes attrs;
  Isa isa;
  std::string error;  // a bad attribute, reported by Compute (throwing here would cross the C API)

  PagedAttention(const OrtApi* api, const OrtKernelInfo* info) : isa(best_isa()) {
    try {
      attrs.num_heads = attr_int(api, info, "num_heads", 0, true);
      attrs.kv_num_heads = attr_int(api, info, "kv_num_heads", 0, true);
      attrs.window = attr_int(api, info, "window", 0, false);
      attrs.rotary_dim = attr_int(api, info, "rotary_dim", 0, false);
      attrs.scale = attr_float(api, info, "scale");
      attrs.softcap = attr_float(api, info, "softcap");
      check(attrs.num_heads > 0 && attrs.kv_num_heads > 0 && attrs.num_heads % attrs.kv_num_heads == 0,
            "num_heads must be a positive multiple of kv_num_heads");
      check(attrs.window >= 0 && attrs.rotary_dim >= 0 && attrs.rotary_dim % 2 == 0 && attrs.softcap >= 0.f,
            "window >= 0, softcap >= 0 and an even rotary_dim >= 0 expected");
    } catch (const std::exception& e) {
      error = e.what();
    }
  }

  Ort::Status Compute(OrtKernelContext* ctx, const Ort::Custom::Tensor<T>& qkv,
                      const Ort::Custom::Tensor<TKV>& key_cache, const Ort::Custom::Tensor<TKV>& value_cache,
                      const Ort::Custom::Tensor<int64_t>& positions,
                      const Ort::Custom::Tensor<int64_t>& slot_mapping,
                      const Ort::Custom::Tensor<int32_t>& block_tables,
                      const Ort::Custom::Tensor<int32_t>& seq_lens,
                      const Ort::Custom::Tensor<int32_t>& query_start,
                      const Ort::Custom::Tensor<float>& cos_cache, const Ort::Custom::Tensor<float>& sin_cache,
                      Ort::Custom::Tensor<T>& out, Ort::Custom::Tensor<TKV>& key_out,
                      Ort::Custom::Tensor<TKV>& value_out) {
    if (!error.empty()) return Ort::Status(error.c_str(), ORT_INVALID_ARGUMENT);
    try {
      run(ctx, qkv, key_cache, value_cache, positions, slot_mapping, block_tables, seq_lens,
          query_start, cos_cache, sin_cache, out, key_out, value_out);
    } catch (const std::exception& e) {
      return Ort::Status(e.what(), ORT_INVALID_ARGUMENT);
    }
    return Ort::Status(nullptr);
  }

  void run(OrtKernelContext* ctx, const Ort::Custom::Tensor<T>& qkv,
           const Ort::Custom::Tensor<TKV>& key_cache, const Ort::Custom::Tensor<TKV>& value_cache,
           const Ort::Custom::Tensor<int64_t>& positions, const Ort::Custom::Tensor<int64_t>& slot_mapping,
           const Ort::Custom::Tensor<int32_t>& block_tables, const Ort::Custom::Tensor<int32_t>& seq_lens,
           const Ort::Custom::Tensor<int32_t>& query_start, const Ort::Custom::Tensor<float>& cos_cache,
           const Ort::Custom::Tensor<float>& sin_cache, Ort::Custom::Tensor<T>& out,
           Ort::Custom::Tensor<TKV>& key_out, Ort::Custom::Tensor<TKV>& value_out) {
    static thread_local Job job;  // per calling thread: its vectors keep their capacity
    Job& J = job;
    const auto& cache_shape = key_cache.Shape();
    check(cache_shape.size() == 4 && value_cache.Shape() == cache_shape, [&] {
      return "key_cache and value_cache must both be (num_blocks, kv_heads, block_size, head_dim), got " +
             shape_str(cache_shape) + " and " + shape_str(value_cache.Shape());
    });
    J.Hq = attrs.num_heads;
    J.Hkv = attrs.kv_num_heads;
    J.G = static_cast<int>(J.Hq / J.Hkv);
    J.NB = cache_shape[0];
    J.block_size = cache_shape[2];
    J.D = cache_shape[3];
    check(cache_shape[1] == J.Hkv, [&] {
      return "the caches hold " + std::to_string(cache_shape[1]) + " KV heads, kv_num_heads is " +
             std::to_string(J.Hkv);
    });
    check(J.D > 0 && J.D % 8 == 0, [&] { return "head_dim must be a multiple of 8, got " + std::to_string(J.D); });
    check(J.block_size > 0 && J.NB > 0, "empty caches");
    J.qkv_stride = (J.Hq + 2 * J.Hkv) * J.D;
    const auto& qkv_shape = qkv.Shape();
    check(qkv_shape.size() == 2 && qkv_shape[1] == J.qkv_stride, [&] {
      return "qkv must be (tokens, " + std::to_string(J.qkv_stride) + "), got " + shape_str(qkv_shape);
    });
    J.N = qkv_shape[0];
    check(is_vector(positions.Shape(), J.N) && is_vector(slot_mapping.Shape(), J.N),
          "positions and slot_mapping must be (tokens,)");
    const auto& table_shape = block_tables.Shape();
    check(table_shape.size() == 2, "block_tables must be (rows, width)");
    J.B = table_shape[0];
    J.table_width = table_shape[1];
    check(is_vector(seq_lens.Shape(), J.B) && is_vector(query_start.Shape(), J.B + 1),
          "seq_lens must be (rows,) and query_start (rows + 1,)");
    J.rot = attrs.rotary_dim;
    J.window = attrs.window;
    J.softcap = attrs.softcap;
    J.scale = attrs.scale != 0.f ? attrs.scale : 1.f / std::sqrt(static_cast<float>(J.D));
    check(J.rot <= J.D, "rotary_dim exceeds head_dim");
    int64_t table_len = 0;
    if (J.rot > 0) {
      const auto& cs = cos_cache.Shape();
      check(cs.size() == 2 && cs[1] == J.rot / 2 && sin_cache.Shape() == cs, [&] {
        return "cos_cache and sin_cache must be (positions, rotary_dim / 2), got " + shape_str(cs);
      });
      table_len = cs[0];
      J.cos = cos_cache.Data();
      J.sin = sin_cache.Data();
    }

    J.qkv = qkv.Data();
    J.positions = positions.Data();
    J.slot_mapping = slot_mapping.Data();
    J.block_tables = block_tables.Data();
    J.query_start = query_start.Data();
    validate_rows(J, seq_lens.Data(), table_len);

    J.out = out.Allocate({J.N, J.Hq * J.D});
    J.key_out = key_out.Allocate(cache_shape);
    J.value_out = value_out.Allocate(cache_shape);
    const size_t cache_bytes = static_cast<size_t>(key_cache.NumberOfElement()) * sizeof(TKV);
    copy_cache(ctx, key_cache.Data(), J.key_out, cache_bytes);  // functional when not aliased
    copy_cache(ctx, value_cache.Data(), J.value_out, cache_bytes);
    if (J.N == 0) return;

    constexpr bool t_half = !std::is_same<T, float>::value, kv_half = !std::is_same<TKV, float>::value;
    const Kernels k = select_kernels(isa, J.D, t_half, kv_half);
    J.write_batches = std::min<int64_t>(J.N, 64);
    parallel(ctx, k.write, static_cast<size_t>(J.write_batches), 0, &J);
    make_items(J, k);
    split_items(J, k);
    parallel(ctx, k.attend, J.items.size(), 0, &J);
    if (!J.splits.empty()) parallel(ctx, k.merge, J.splits.size(), 0, &J);
  }

};

using Op32 = PagedAttention<float, float>;
using Op16 = PagedAttention<Ort::Float16_t, Ort::Float16_t>;
using Op32Kv16 = PagedAttention<float, Ort::Float16_t>;

std::mutex registry_mutex;
std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>>& ops() {
  static std::vector<std::unique_ptr<Ort::Custom::OrtLiteCustomOp>> all;
  return all;
}
std::vector<Ort::CustomOpDomain>& domains() {
  static std::vector<Ort::CustomOpDomain> all;
  return all;
}

}  // namespace
}  // namespace inferflow

// The float16 tensors arrive as Ort::Float16_t; the kernels read their raw uint16_t bits.
static_assert(sizeof(Ort::Float16_t) == sizeof(uint16_t), "Float16_t is 16 bits");

extern "C" {

// Which kernel set this CPU gets (for `python -m inferflow.runtimes.ort_ops`).
__attribute__((visibility("default"))) const char* InferflowPagedAttentionIsa() {
  return inferflow::isa_name(inferflow::best_isa());
}

__attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                                   const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // cannot even report it: the runtime is older than API 21
  Ort::InitApi(api);
  try {
    std::lock_guard<std::mutex> lock(inferflow::registry_mutex);
    auto& ops = inferflow::ops();
    if (ops.empty()) {
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<inferflow::Op32>("PagedAttention", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<inferflow::Op16>("PagedAttention", "CPUExecutionProvider"));
      ops.emplace_back(Ort::Custom::CreateLiteCustomOp<inferflow::Op32Kv16>("PagedAttention", "CPUExecutionProvider"));
    }
    Ort::CustomOpDomain domain{"inferflow"};
    for (auto& op : ops) domain.Add(op.get());
    Ort::UnownedSessionOptions(options).Add(domain);
    inferflow::domains().push_back(std::move(domain));  // must outlive the sessions
  } catch (const std::exception& e) {
    return Ort::Status(e.what(), ORT_RUNTIME_EXCEPTION).release();
  }
  return nullptr;
}

}  // extern "C"
