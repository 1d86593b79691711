// Grouped-query decode attention that reads each KV head once for all of its query heads: the
// kernel `benchmarks/decode_attention_kernel.py` times beside ONNX Runtime's CPU
// GroupQueryAttention (which runs two small GEMMs per query head, so a KV head is read once per
// query head of its group). A measuring stick, not a serving kernel: one new token per row,
// queries already rotated, no KV write; OpenMP threads where a real op would use the runtime's.
//
// Shapes: q (B, Hq * D) float32; k, v (B, Hkv, C, D) float32 slot buffers of capacity C;
// context[b] tokens valid in slot b (1 <= context[b] <= C); out (B, Hq * D).
// Query head j belongs to KV head j / (Hq / Hkv), as in GroupQueryAttention.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

extern "C" void decode_attention(const float* q, const float* k, const float* v,
                                 const int* context, int B, int Hq, int Hkv, int C, int D,
                                 float* out) {
  const int G = Hq / Hkv;  // query heads per KV head
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    std::vector<float> scores(static_cast<size_t>(G) * C);  // (G, C) this thread's scratch
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; ++item) {  // one (row, KV head) per item
      const int b = item / Hkv, h = item % Hkv, T = context[b];
      const float* kh = k + (static_cast<size_t>(b) * Hkv + h) * C * D;
      const float* vh = v + (static_cast<size_t>(b) * Hkv + h) * C * D;
      const float* qg = q + static_cast<size_t>(b) * Hq * D + static_cast<size_t>(h) * G * D;
      float* og = out + static_cast<size_t>(b) * Hq * D + static_cast<size_t>(h) * G * D;
      // scores: every key row once, dotted with the G queries of the group
      for (int t = 0; t < T; ++t) {
        const float* kt = kh + static_cast<size_t>(t) * D;
        for (int g = 0; g < G; ++g) {
          const float* qq = qg + static_cast<size_t>(g) * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int d = 0; d < D; ++d) acc += qq[d] * kt[d];
          scores[static_cast<size_t>(g) * C + t] = acc * scale;
        }
      }
      for (int g = 0; g < G; ++g) {  // softmax of each query head's scores
        float* s = scores.data() + static_cast<size_t>(g) * C;
        float m = s[0], sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int t = 0; t < T; ++t) m = std::max(m, s[t]);
#pragma omp simd
        for (int t = 0; t < T; ++t) s[t] = expf(s[t] - m);
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < T; ++t) sum += s[t];
        const float inv = 1.f / sum;
#pragma omp simd
        for (int t = 0; t < T; ++t) s[t] *= inv;
        std::fill(og + static_cast<size_t>(g) * D, og + static_cast<size_t>(g + 1) * D, 0.f);
      }
      // outputs: every value row once, weighted into the G outputs
      for (int t = 0; t < T; ++t) {
        const float* vt = vh + static_cast<size_t>(t) * D;
        for (int g = 0; g < G; ++g) {
          const float p = scores[static_cast<size_t>(g) * C + t];
          float* o = og + static_cast<size_t>(g) * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) o[d] += p * vt[d];
        }
      }
    }
  }
}
