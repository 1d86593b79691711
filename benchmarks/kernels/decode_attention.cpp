// Grouped-query decode attention that reads each KV head once for all of its query heads: the
// kernel `benchmarks/decode_attention_kernel.py` times beside ONNX Runtime's CPU
// GroupQueryAttention (which runs two small GEMMs per query head, so a KV head is read once per
// query head of its group), and `benchmarks/decode_split.py` runs between ONNX Runtime calls over
// the engine's own KV (`decode_layer`). A measuring stick, not a serving kernel: OpenMP threads
// where a real op would use the runtime's.
//
// Shapes: q (B, Hq * D) float32; k, v (S, Hkv, C, D) float32 slot buffers of capacity C;
// row b attends over the first context[b] positions of slot slots[b] (1 <= context[b] <= C);
// out (B, Hq * D). Query head j belongs to KV head j / (Hq / Hkv), as in GroupQueryAttention.
// With AVX-512 and D = 64 (the ~100M model's heads), scores come 16 keys at a time (one
// transpose-add tree instead of 16 horizontal sums) and a group's outputs stay in registers;
// other shapes take the portable loops.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// softmax over s[0, T), in place
void softmax(float* s, int T) {
  float m = s[0], sum = 0.f;
  for (int t = 1; t < T; ++t) m = std::max(m, s[t]);
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < T; ++t) {
    s[t] = expf(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int t = 0; t < T; ++t) s[t] *= inv;
}

// scores[g * stride + t] = q_g . k_t * scale, then softmax per query head
void scores_portable(const float* qg, const float* kh, int G, int T, int D, float scale,
                     float* scores, size_t stride) {
  for (int t = 0; t < T; ++t) {
    const float* kt = kh + static_cast<size_t>(t) * D;
    for (int g = 0; g < G; ++g) {
      const float* qq = qg + static_cast<size_t>(g) * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int d = 0; d < D; ++d) acc += qq[d] * kt[d];
      scores[g * stride + t] = acc * scale;
    }
  }
}

// og[g] = sum_t p_g[t] v_t
void values_portable(const float* vh, const float* scores, size_t stride, int G, int T, int D,
                     float* og) {
  std::fill(og, og + static_cast<size_t>(G) * D, 0.f);
  for (int t = 0; t < T; ++t) {
    const float* vt = vh + static_cast<size_t>(t) * D;
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * stride + t];
      float* o = og + static_cast<size_t>(g) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) o[d] += p * vt[d];
    }
  }
}

#if defined(__AVX512F__)
// lane i of the result = the sum of v[i]'s 16 lanes
inline __m512 sum16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// D = 64: one key row is four vectors
inline __m512 dot64(const __m512 q[4], const float* kt) {
  __m512 x = _mm512_mul_ps(q[0], _mm512_loadu_ps(kt));
  x = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(kt + 16), x);
  x = _mm512_fmadd_ps(q[2], _mm512_loadu_ps(kt + 32), x);
  return _mm512_fmadd_ps(q[3], _mm512_loadu_ps(kt + 48), x);
}

void scores_avx512(const float* qg, const float* kh, int G, int T, float scale, float* scores,
                   size_t stride) {
  for (int g = 0; g < G; ++g) {
    __m512 q[4];
    for (int c = 0; c < 4; ++c) q[c] = _mm512_mul_ps(_mm512_loadu_ps(qg + g * 64 + c * 16), _mm512_set1_ps(scale));
    float* s = scores + g * stride;
    int t = 0;
    for (; t + 16 <= T; t += 16) {  // 16 keys (4 KiB, in L1 for the group's next query) at once
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = dot64(q, kh + static_cast<size_t>(t + j) * 64);
      _mm512_storeu_ps(s + t, sum16(acc));
    }
    for (; t < T; ++t) s[t] = _mm512_reduce_add_ps(dot64(q, kh + static_cast<size_t>(t) * 64));
  }
}

template <int G>
void values_avx512(const float* vh, const float* scores, size_t stride, int T, float* og) {
  __m512 o[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) o[g][c] = _mm512_setzero_ps();
  for (int t = 0; t < T; ++t) {
    const float* vt = vh + static_cast<size_t>(t) * 64;
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps(vt + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * stride + t]);
      for (int c = 0; c < 4; ++c) o[g][c] = _mm512_fmadd_ps(p, v[c], o[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(og + g * 64 + c * 16, o[g][c]);
}
#endif

void attend(const float* q, const float* k, const float* v, const long long* slots,
            const int* context, int B, int Hq, int Hkv, int C, int D, float* out) {
  const int G = Hq / Hkv;  // query heads per KV head
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const size_t stride = static_cast<size_t>(C) + 16;
#pragma omp parallel
  {
    std::vector<float> scores(static_cast<size_t>(G) * stride);  // (G, C) this thread's scratch
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < B * Hkv; ++item) {  // one (row, KV head) per item
      const int b = item / Hkv, h = item % Hkv, T = context[b];
      const size_t head = (static_cast<size_t>(slots ? slots[b] : b) * Hkv + h) * C * D;
      const float* qg = q + static_cast<size_t>(b) * Hq * D + static_cast<size_t>(h) * G * D;
      float* og = out + static_cast<size_t>(b) * Hq * D + static_cast<size_t>(h) * G * D;
#if defined(__AVX512F__)
      if (D == 64 && G <= 4) {
        scores_avx512(qg, k + head, G, T, scale, scores.data(), stride);
        for (int g = 0; g < G; ++g) softmax(scores.data() + g * stride, T);
        switch (G) {
          case 1: values_avx512<1>(v + head, scores.data(), stride, T, og); break;
          case 2: values_avx512<2>(v + head, scores.data(), stride, T, og); break;
          case 3: values_avx512<3>(v + head, scores.data(), stride, T, og); break;
          default: values_avx512<4>(v + head, scores.data(), stride, T, og); break;
        }
        continue;
      }
#endif
      scores_portable(qg, k + head, G, T, D, scale, scores.data(), stride);
      for (int g = 0; g < G; ++g) softmax(scores.data() + g * stride, T);
      values_portable(v + head, scores.data(), stride, G, T, D, og);
    }
  }
}

// rotate x (n heads of D) in place at one position: the non-interleaved (GPT-NeoX) form that
// GroupQueryAttention applies with rotary_interleaved=0; cos, sin are that position's (D / 2,)
void rotate(float* x, int n, int D, const float* cos, const float* sin) {
  const int half = D / 2;
  for (int h = 0; h < n; ++h) {
    float* a = x + static_cast<size_t>(h) * D;
    float* b = a + half;
#pragma omp simd
    for (int i = 0; i < half; ++i) {
      const float x1 = a[i], x2 = b[i];
      a[i] = x1 * cos[i] - x2 * sin[i];
      b[i] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

}  // namespace

// The benchmark's form: row b in slot b, queries already rotated, no KV write.
extern "C" void decode_attention(const float* q, const float* k, const float* v,
                                 const int* context, int B, int Hq, int Hkv, int C, int D,
                                 float* out) {
  attend(q, k, v, nullptr, context, B, Hq, Hkv, C, D, out);
}

// One layer of a decode step, what GroupQueryAttention does for one new token per row:
// qkv (B, (Hq + 2 Hkv) D) is each row's packed projection; its q and k are rotated at
// positions[b] (in place), its k and v written to position positions[b] of slot slots[b], and
// the row attends over positions [0, positions[b]]. cos, sin: (capacity, D / 2) tables.
extern "C" void decode_layer(float* qkv, const long long* slots, const int* positions,
                             const float* cos, const float* sin, float* k, float* v, int B,
                             int Hq, int Hkv, int C, int D, float* q_out, float* out) {
  const size_t width = static_cast<size_t>(Hq + 2 * Hkv) * D, kv_width = static_cast<size_t>(Hkv) * D;
  std::vector<int> context(B);
  for (int b = 0; b < B; ++b) {
    float* row = qkv + b * width;
    const int p = positions[b];
    const float* c = cos + static_cast<size_t>(p) * (D / 2);
    const float* s = sin + static_cast<size_t>(p) * (D / 2);
    rotate(row, Hq + Hkv, D, c, s);  // q heads then k heads, contiguous in the packed row
    std::copy(row, row + static_cast<size_t>(Hq) * D, q_out + static_cast<size_t>(b) * Hq * D);
    for (int h = 0; h < Hkv; ++h) {
      const size_t at = ((static_cast<size_t>(slots[b]) * Hkv + h) * C + p) * D;
      std::copy(row + static_cast<size_t>(Hq) * D + h * D, row + static_cast<size_t>(Hq) * D + (h + 1) * D, k + at);
      std::copy(row + static_cast<size_t>(Hq) * D + kv_width + h * D,
                row + static_cast<size_t>(Hq) * D + kv_width + (h + 1) * D, v + at);
    }
    context[b] = p + 1;
  }
  attend(q_out, k, v, slots, context.data(), B, Hq, Hkv, C, D, out);
}
