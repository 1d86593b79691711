// The kernels' vector layer: the vector type V of IF_W floats (GCC vector extensions), a few
// per-set intrinsics (fma, fp16 loads and stores, the transpose-add tree), exp and tanh, rows
// in and out of the packed layouts, per-thread scratch.
// Not a translation unit of its own: paged_attention.cc includes it once per instruction set,
// inside namespace isa_<name> and under that set's target pragma, with IF_ISA (0 portable,
// 1 AVX2+FMA+F16C, 2 AVX-512F/BW/DQ/VL) and IF_W (float lanes per vector: 4, 8, 16) defined.

constexpr int W = IF_W;
typedef float V __attribute__((vector_size(W * sizeof(float))));
typedef int32_t VI __attribute__((vector_size(W * sizeof(int32_t))));

// Register blocking, sized to the register file (32 zmm / 16 ymm / 16 xmm).
#if IF_ISA == 2
constexpr int kScoreKeys = 6, kScorePanel = 4;  // tile S': 6 keys x 4 row vectors = 24 accumulators
constexpr int kValueRows = 6, kValuePanel = 4;  // tile O: 6 rows x 4 dim vectors
constexpr int kSmallAcc = 16;                   // small path: rows x dim vectors in registers
#else
constexpr int kScoreKeys = 3, kScorePanel = 3;
constexpr int kValueRows = 2, kValuePanel = 4;
constexpr int kSmallAcc = 8;
#endif
constexpr int kSmallRows = W / 2;  // more rows than this: the tile path fills the lanes better
constexpr int kChunk = 64;         // tile path: keys per online-softmax step

// ---------------------------------------------------------------------------------------------
// vector primitives

inline V vsplat(float x) {  // (not V{} + x: that turns -0.f into +0.f)
#if IF_ISA == 2
  return (V)_mm512_set1_ps(x);
#elif IF_ISA == 1
  return (V)_mm256_set1_ps(x);
#else
  V v;
  for (int i = 0; i < W; ++i) v[i] = x;
  return v;
#endif
}
inline V vload(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline V vload(const uint16_t* p) {  // fp16 -> fp32
#if IF_ISA == 2
  return (V)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif IF_ISA == 1
  return (V)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  V v;
  for (int i = 0; i < W; ++i) v[i] = f16_to_f32(p[i]);
  return v;
#endif
}
inline void vstore(float* p, V v) { __builtin_memcpy(p, &v, sizeof v); }
inline void vstore(uint16_t* p, V v) {  // fp32 -> fp16, round to nearest even
#if IF_ISA == 2
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif IF_ISA == 1
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int i = 0; i < W; ++i) p[i] = f32_to_f16(v[i]);
#endif
}
inline V vfma(V a, V b, V c) {
#if IF_ISA == 2
  return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif IF_ISA == 1
  return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline V vselect(VI mask, V a, V b) {  // mask lanes all-ones: a, else b
  return (V)(((VI)a & mask) | ((VI)b & ~mask));
}
inline V vmax(V a, V b) {
#if IF_ISA == 2
  return (V)_mm512_max_ps((__m512)a, (__m512)b);
#elif IF_ISA == 1
  return (V)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return vselect(a > b, a, b);
#endif
}
inline float hsum(V v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}
inline float hmax(V v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// Prefetch a cache row (D elements) into L1: pages of the pool are scattered, so the hardware
// prefetcher cannot run ahead across blocks.
template <class TKV>
inline void prefetch_row(const TKV* row, int D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int at = 0; at < D * static_cast<int>(sizeof(TKV)); at += 64) __builtin_prefetch(p + at, 0, 3);
}
constexpr int kPrefetchKeys = 4 * W;  // how far ahead the small path's streams prefetch

// exp on the whole float range that matters here (inputs <= 0 in softmax): Cephes' expf
// polynomial (about 1 ulp); x < -87.3 (and -inf) gives exactly 0.
inline V vexp(V x) {
  const VI under = x < vsplat(-87.33654f);
  x = vmax(x, vsplat(-87.33654f));
  x = vselect(x > vsplat(88.f), vsplat(88.f), x);
#if IF_ISA == 2
  const V fn = (V)_mm512_roundscale_ps((__m512)(x * vsplat(1.44269504088896341f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const V magic = vsplat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const V t = vfma(x, vsplat(1.44269504088896341f), magic);
  const V fn = t - magic;
#endif
  V r = vfma(fn, vsplat(-0.693359375f), x);
  r = vfma(fn, vsplat(2.12194440e-4f), r);
  V p = vsplat(1.9875691500E-4f);
  p = vfma(p, r, vsplat(1.3981999507E-3f));
  p = vfma(p, r, vsplat(8.3334519073E-3f));
  p = vfma(p, r, vsplat(4.1665795894E-2f));
  p = vfma(p, r, vsplat(1.6666665459E-1f));
  p = vfma(p, r, vsplat(5.0000001201E-1f));
  p = vfma(p, r * r, r) + vsplat(1.f);
#if IF_ISA == 2
  const V y = (V)_mm512_scalef_ps((__m512)p, (__m512)fn);
#else
  const V y = p * (V)(((VI)t - (VI)magic + 127) << 23);
#endif
  return (V)((VI)y & ~under);
}

// tanh (Cephes' tanhf): a polynomial below |x| = 0.625, else 1 - 2 / (exp(2|x|) + 1)
inline V vtanh(V x) {
  const VI sign = (VI)vsplat(-0.f);
  const V a = (V)((VI)x & ~sign);
  const V z = x * x;
  V p = vsplat(-5.70498872745E-3f);
  p = vfma(p, z, vsplat(2.06390887954E-2f));
  p = vfma(p, z, vsplat(-5.37397155531E-2f));
  p = vfma(p, z, vsplat(1.33314422036E-1f));
  p = vfma(p, z, vsplat(-3.33332819422E-1f));
  const V small = vfma(p * z, x, x);
  const V e = vexp(vsplat(-2.f) * a);
  const V big = (V)((VI)((vsplat(1.f) - e) / (vsplat(1.f) + e)) | ((VI)x & sign));
  return vselect(a < vsplat(0.625f), small, big);
}

inline V vsoftcap(V s, float cap) { return vsplat(cap) * vtanh(s * (1.f / cap)); }

// lane i of the result = the sum of a[i]'s lanes (W dot products finished at once)
inline V sum_tree(V a[W]) {
#if IF_ISA == 2
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 u = (__m512)a[2 * i], v = (__m512)a[2 * i + 1];
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(u, v), _mm512_unpackhi_ps(u, v));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d u = _mm512_castps_pd(x[2 * i]), v = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
  }
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xdd));
  return (V)_mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                          _mm512_shuffle_f32x4(z[0], z[1], 0xdd));
#elif IF_ISA == 1
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
  const __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
  const __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return (V)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  V out;
  for (int i = 0; i < W; ++i) out[i] = hsum(a[i]);
  return out;
#endif
}

// ---------------------------------------------------------------------------------------------
// rows in and out of the packed layouts

template <class T>
inline void load_row(const T* src, float* dst, int D) {  // D % W == 0
  for (int d = 0; d < D; d += W) vstore(dst + d, vload(src + d));
}
template <class T>
inline void store_row(const float* src, T* dst, int D) {
  for (int d = 0; d < D; d += W) vstore(dst + d, vload(src + d));
}

// non-interleaved rotary over the first 2 * half dims: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
inline void rotate(float* x, const float* cos, const float* sin, int half) {
  for (int i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// Query row r of an item: token qs + q0 + r / G, query head h * G + r % G; rotated, scaled.
template <class T>
inline void load_query(const Job& J, const Item& it, int r, float* dst) {
  const int64_t n = J.query_start[it.b] + it.q0 + r / J.G;
  const int64_t head = static_cast<int64_t>(it.h) * J.G + r % J.G;
  const T* src = static_cast<const T*>(J.qkv) + n * J.qkv_stride + head * J.D;
  load_row(src, dst, J.D);
  if (J.rot) {
    const int64_t p = J.positions[n];
    rotate(dst, J.cos + p * (J.rot / 2), J.sin + p * (J.rot / 2), static_cast<int>(J.rot / 2));
  }
  const V s = vsplat(J.scale);
  for (int d = 0; d < J.D; d += W) vstore(dst + d, vload(dst + d) * s);
}

template <class T>
inline void store_output(const Job& J, const Item& it, int r, const float* o, float inv) {
  const int64_t n = J.query_start[it.b] + it.q0 + r / J.G;
  const int64_t head = static_cast<int64_t>(it.h) * J.G + r % J.G;
  T* dst = static_cast<T*>(J.out) + n * J.Hq * J.D + head * J.D;
  const V s = vsplat(inv);
  for (int d = 0; d < J.D; d += W) vstore(dst + d, vload(o + d) * s);
}

// Row pointers of keys (or values) lo .. lo + count - 1 of item's row and KV head, through the
// block table: position j lives in block tables[b, j / bs] at offset j % bs.
template <class TKV>
inline void gather_rows(const Job& J, const Item& it, const TKV* cache, int64_t lo, int count,
                        const TKV** rows) {
  const int32_t* table = J.block_tables + static_cast<int64_t>(it.b) * J.table_width;
  const int64_t bs = J.block_size, head_stride = bs * J.D;
  int64_t j = lo;
  int i = 0;
  while (i < count) {
    const int64_t block = table[j / bs], off = j % bs;
    const TKV* base = cache + (block * J.Hkv + it.h) * head_stride;
    const int run = static_cast<int>(std::min<int64_t>(bs - off, count - i));
    for (int t = 0; t < run; ++t) rows[i + t] = base + (off + t) * J.D;
    i += run;
    j += run;
  }
}

// Per-thread scratch, grown on demand and kept between calls.
struct Scratch {
  std::vector<float> q, s, o, st, kbuf, vbuf, m, l, alpha;
  std::vector<int32_t> rowpos;
  std::vector<const void*> kp, vp;
  std::vector<const float*> kf, vf;
  template <class X>
  static X* get(std::vector<X>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};
static thread_local Scratch tls;
