// The kernels of inferflow.PagedAttention for one instruction set. Not a translation unit of its
// own: paged_attention.cc includes this file once per instruction set, inside namespace
// isa_<name> and under that set's target pragma, with IF_ISA (0 portable, 1 AVX2+FMA+F16C,
// 2 AVX-512F/BW/DQ/VL) and IF_W (float lanes per vector: 4, 8, 16) defined. Everything here is
// written once over the vector type V of IF_W floats (GCC vector extensions) plus a handful of
// per-set intrinsics (fma, fp16 loads/stores, the transpose-add tree).
//
// Two attention paths, both reading each KV head once for the G query heads of its group:
// - small (decode: a row's query tokens x G <= kSmallRows): keys in lanes. Scores of W keys at a
//   time for each query row (W dot products, one transpose-add tree), the row's softmax over its
//   whole visible range, then the values with the rows' outputs in registers.
// - tile (prefill chunks): a tile of query tokens x G rows in lanes. Key chunks of kChunk keys:
//   S' (keys x rows) = K Q' by outer products (no horizontal sums), online softmax per row
//   (flash attention), O (rows x D) += P V by outer products.

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

// ---------------------------------------------------------------------------------------------
// write phase: rotate each token's k and store its k and v in its slot

template <class T, class TKV>
void write_tokens(const Job& J, int64_t n0, int64_t n1) {
  const int D = static_cast<int>(J.D);
  float* buf = Scratch::get(tls.kbuf, static_cast<size_t>(D));
  TKV* kc = static_cast<TKV*>(J.key_out);
  TKV* vc = static_cast<TKV*>(J.value_out);
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t slot = J.slot_mapping[n];
    const int64_t block = slot / J.block_size, off = slot % J.block_size;
    const T* row = static_cast<const T*>(J.qkv) + n * J.qkv_stride;
    for (int64_t h = 0; h < J.Hkv; ++h) {
      const int64_t at = ((block * J.Hkv + h) * J.block_size + off) * J.D;
      load_row(row + (J.Hq + h) * J.D, buf, D);
      if (J.rot) {
        const int64_t p = J.positions[n];
        rotate(buf, J.cos + p * (J.rot / 2), J.sin + p * (J.rot / 2), static_cast<int>(J.rot / 2));
      }
      store_row(buf, kc + at, D);
      load_row(row + (J.Hq + J.Hkv + h) * J.D, buf, D);
      store_row(buf, vc + at, D);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// small path: keys in lanes

// S[r, t] = q_r . k_t for t < T (rows of Q are D floats, S rows ss floats)
template <class TKV>
void small_scores(const float* Q, int M, int D, const TKV* const* kp, int T, float* S, int ss) {
  int t = 0;
  for (; t + W <= T; t += W) {
    const TKV* const* k = kp + t;
    for (int i = t + kPrefetchKeys; i < std::min(T, t + kPrefetchKeys + W); ++i) prefetch_row(kp[i], D);
    for (int r = 0; r < M; ++r) {
      const float* q = Q + r * D;
      V acc[W];
      for (int i = 0; i < W; ++i) acc[i] = V{};
      for (int d = 0; d < D; d += W) {
        const V qv = vload(q + d);
        for (int i = 0; i < W; ++i) acc[i] = vfma(qv, vload(k[i] + d), acc[i]);
      }
      vstore(S + r * ss + t, sum_tree(acc));
    }
  }
  for (; t < T; ++t)
    for (int r = 0; r < M; ++r) {
      V acc = {};
      for (int d = 0; d < D; d += W) acc = vfma(vload(Q + r * D + d), vload(kp[t] + d), acc);
      S[r * ss + t] = hsum(acc);
    }
}

// softmax numerators exp(s - max) of s[a .. e] in place (softcap first), zero outside; returns
// their sum and sets *max (-inf and 0 for an empty range)
float small_softmax(float* s, int a, int e, int T, float softcap, float* max) {
  for (int t = 0; t < std::min(a, T); ++t) s[t] = 0.f;
  for (int t = std::max(e + 1, 0); t < T; ++t) s[t] = 0.f;
  *max = -INFINITY;
  if (a > e) return 0.f;
  int t = a;
  if (softcap > 0.f) {
    for (; t + W <= e + 1; t += W) vstore(s + t, vsoftcap(vload(s + t), softcap));
    for (; t <= e; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  }
  V mv = vsplat(-INFINITY);
  for (t = a; t + W <= e + 1; t += W) mv = vmax(mv, vload(s + t));
  float m = hmax(mv);
  for (; t <= e; ++t) m = std::max(m, s[t]);
  V sv = {};
  const V mm = vsplat(m);
  for (t = a; t + W <= e + 1; t += W) {
    const V p = vexp(vload(s + t) - mm);
    vstore(s + t, p);
    sv += p;
  }
  float sum = hsum(sv);
  for (; t <= e; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  *max = m;
  return sum;
}

// O[r0 + r, d0 + ...] = sum_t S[r0 + r, t] v_t for MR rows and DP vectors of dims
template <class TKV, int MR, int DP>
void small_values_block(const float* S, int ss, int r0, const TKV* const* vp, int T, int d0,
                        float* O, int D) {
  V acc[MR][DP];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DP; ++c) acc[r][c] = V{};
  for (int t = 0; t < T; ++t) {
    if (r0 == 0 && d0 == 0 && t + kPrefetchKeys < T) prefetch_row(vp[t + kPrefetchKeys], D);
    V v[DP];
    for (int c = 0; c < DP; ++c) v[c] = vload(vp[t] + d0 + c * W);
    for (int r = 0; r < MR; ++r) {
      const V p = vsplat(S[(r0 + r) * ss + t]);
      for (int c = 0; c < DP; ++c) acc[r][c] = vfma(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DP; ++c) vstore(O + (r0 + r) * D + d0 + c * W, acc[r][c]);
}

template <class TKV, int DP>
void small_values_panel(const float* S, int ss, int M, const TKV* const* vp, int T, int d0,
                        float* O, int D) {
  constexpr int kRows = kSmallAcc / DP < 4 ? kSmallAcc / DP : 4;
  int r = 0;
  for (; r + kRows <= M; r += kRows) small_values_block<TKV, kRows, DP>(S, ss, r, vp, T, d0, O, D);
  switch (M - r) {
    case 1: small_values_block<TKV, 1, DP>(S, ss, r, vp, T, d0, O, D); break;
    case 2: if constexpr (kRows > 2) small_values_block<TKV, 2, DP>(S, ss, r, vp, T, d0, O, D); break;
    case 3: if constexpr (kRows > 3) small_values_block<TKV, 3, DP>(S, ss, r, vp, T, d0, O, D); break;
    default: break;
  }
}

template <class TKV>
void small_values(const float* S, int ss, int M, const TKV* const* vp, int T, float* O, int D) {
  int d0 = 0;
  const int vectors = D / W;
  for (int c = 0; c < vectors;) {
    const int dp = std::min(vectors - c, 4);
    switch (dp) {
      case 4: small_values_panel<TKV, 4>(S, ss, M, vp, T, d0, O, D); break;
      case 3: small_values_panel<TKV, 3>(S, ss, M, vp, T, d0, O, D); break;
      case 2: small_values_panel<TKV, 2>(S, ss, M, vp, T, d0, O, D); break;
      default: small_values_panel<TKV, 1>(S, ss, M, vp, T, d0, O, D); break;
    }
    c += dp;
    d0 += dp * W;
  }
}

// Keys lo + it.k0 .. lo + it.k1 - 1 of the item's range [lo, last] (all of it when k1 < 0). A
// whole item writes the output; a split (part >= 0) writes its unnormalised O, row maxima and
// sums to J.partial for merge_split.
template <class T, class TKV>
void small_item(const Job& J, const Item& it) {
  const int D = static_cast<int>(J.D), G = J.G;
  const int M = (it.q1 - it.q0) * G;
  const int64_t first = J.row_start[it.b] + it.q0, last = J.row_start[it.b] + it.q1 - 1;
  const int64_t lo_all = J.window > 0 ? std::max<int64_t>(0, first - J.window + 1) : 0;
  const int64_t lo = lo_all + std::max(it.k0, 0);
  const int64_t hi = it.k1 < 0 ? last : lo_all + it.k1 - 1;
  const int nk = static_cast<int>(hi - lo + 1);  // keys lo .. hi
  const int ss = (nk + W - 1) / W * W;
  float* Q = Scratch::get(tls.q, static_cast<size_t>(M) * D);
  float* S = Scratch::get(tls.s, static_cast<size_t>(M) * ss);
  float* O = Scratch::get(tls.o, static_cast<size_t>(M) * D);
  float* l = Scratch::get(tls.l, static_cast<size_t>(M));
  float* m = Scratch::get(tls.m, static_cast<size_t>(M));
  const TKV** kp = reinterpret_cast<const TKV**>(Scratch::get(tls.kp, static_cast<size_t>(nk)));
  const TKV** vp = reinterpret_cast<const TKV**>(Scratch::get(tls.vp, static_cast<size_t>(nk)));
  gather_rows(J, it, static_cast<const TKV*>(J.key_out), lo, nk, kp);
  gather_rows(J, it, static_cast<const TKV*>(J.value_out), lo, nk, vp);
  for (int r = 0; r < M; ++r) load_query<T>(J, it, r, Q + r * D);
  small_scores(Q, M, D, kp, nk, S, ss);
  for (int r = 0; r < M; ++r) {  // row r sees keys (p - window, p] of [lo, hi]
    const int64_t p = first + r / G;
    const int64_t a = J.window > 0 ? std::max<int64_t>(lo, p - J.window + 1) : lo;
    const int64_t e = std::min(p, hi);
    l[r] = small_softmax(S + r * ss, static_cast<int>(a - lo), static_cast<int>(e - lo), nk, J.softcap, m + r);
  }
  small_values(S, ss, M, vp, nk, O, D);
  if (it.part < 0) {
    for (int r = 0; r < M; ++r) store_output<T>(J, it, r, O + r * D, 1.f / l[r]);
    return;
  }
  float* part = J.partial + static_cast<size_t>(it.part) * J.part_stride;  // O (M, D), m (M), l (M)
  std::copy(O, O + static_cast<size_t>(M) * D, part);
  std::copy(m, m + M, part + static_cast<size_t>(M) * D);
  std::copy(l, l + M, part + static_cast<size_t>(M) * D + M);
}

// The output of split item group i: the parts' O rescaled to the largest row maximum.
template <class T>
void merge_split(void* job, size_t i) {
  const Job& J = *static_cast<const Job*>(job);
  const Split& sp = J.splits[i];
  const int D = static_cast<int>(J.D), M = (sp.item.q1 - sp.item.q0) * J.G;
  float* O = Scratch::get(tls.o, static_cast<size_t>(M) * D);
  for (int r = 0; r < M; ++r) {
    float mx = -INFINITY;
    for (int k = 0; k < sp.count; ++k)
      mx = std::max(mx, J.partial[static_cast<size_t>(sp.first + k) * J.part_stride + static_cast<size_t>(M) * D + r]);
    float l = 0.f;
    const V zero = {};
    for (int d = 0; d < D; d += W) vstore(O + r * D + d, zero);
    for (int k = 0; k < sp.count; ++k) {
      const float* part = J.partial + static_cast<size_t>(sp.first + k) * J.part_stride;
      const float pm = part[static_cast<size_t>(M) * D + r];
      if (pm == -INFINITY) continue;  // no key of this part is visible to row r
      const float w = std::exp(pm - mx);
      l += w * part[static_cast<size_t>(M) * D + M + r];
      const V wv = vsplat(w);
      for (int d = 0; d < D; d += W) vstore(O + r * D + d, vfma(wv, vload(part + r * D + d), vload(O + r * D + d)));
    }
    store_output<T>(J, sp.item, r, O + r * D, 1.f / l);
  }
}

// ---------------------------------------------------------------------------------------------
// tile path: query rows in lanes

// S'[k, rows] (k < NR keys, MV row vectors of the panel at Qt + v0 * W) = sum_d K[k, d] Q'[d, rows]
template <int NR, int MV>
void tile_scores_block(const float* const* kp, const float* Qt, int Mp, int D, float* St) {
  V acc[NR][MV];
  for (int k = 0; k < NR; ++k)
    for (int v = 0; v < MV; ++v) acc[k][v] = V{};
  for (int d = 0; d < D; ++d) {
    V q[MV];
    for (int v = 0; v < MV; ++v) q[v] = vload(Qt + d * Mp + v * W);
    for (int k = 0; k < NR; ++k) {
      const V kv = vsplat(kp[k][d]);
      for (int v = 0; v < MV; ++v) acc[k][v] = vfma(kv, q[v], acc[k][v]);
    }
  }
  for (int k = 0; k < NR; ++k)
    for (int v = 0; v < MV; ++v) vstore(St + k * Mp + v * W, acc[k][v]);
}

template <int MV>
void tile_scores_panel(const float* const* kp, int nk, const float* Qt, int Mp, int D, float* St) {
  int k = 0;
  for (; k + kScoreKeys <= nk; k += kScoreKeys)
    tile_scores_block<kScoreKeys, MV>(kp + k, Qt, Mp, D, St + k * Mp);
  for (int left = nk - k; left > 0; left = nk - k) {  // the rest in one or two smaller blocks
    if (left >= 4) {
      tile_scores_block<4, MV>(kp + k, Qt, Mp, D, St + k * Mp);
      k += 4;
    } else if (left >= 2) {
      tile_scores_block<2, MV>(kp + k, Qt, Mp, D, St + k * Mp);
      k += 2;
    } else {
      tile_scores_block<1, MV>(kp + k, Qt, Mp, D, St + k * Mp);
      k += 1;
    }
  }
}

void tile_scores(const float* const* kp, int nk, const float* Qt, int Mp, int D, float* St) {
  const int vectors = Mp / W;
  for (int v0 = 0; v0 < vectors;) {
    const int mv = std::min(vectors - v0, kScorePanel);
    const float* q = Qt + v0 * W;
    float* s = St + v0 * W;
    switch (mv) {
      case 4: if constexpr (kScorePanel >= 4) tile_scores_panel<4>(kp, nk, q, Mp, D, s); break;
      case 3: tile_scores_panel<3>(kp, nk, q, Mp, D, s); break;
      case 2: tile_scores_panel<2>(kp, nk, q, Mp, D, s); break;
      default: tile_scores_panel<1>(kp, nk, q, Mp, D, s); break;
    }
    v0 += mv;
  }
}

// O[r0 + r, d0 + ...] = alpha[r0 + r] O[...] + sum_k P'[k, r0 + r] v_k
template <int MR, int DP>
void tile_values_block(const float* Pt, int Mp, int r0, const float* const* vp, int nk, int d0,
                       const float* alpha, float* O, int D) {
  V acc[MR][DP];
  for (int r = 0; r < MR; ++r) {
    const V a = vsplat(alpha[r0 + r]);
    for (int c = 0; c < DP; ++c) acc[r][c] = vload(O + (r0 + r) * D + d0 + c * W) * a;
  }
  for (int k = 0; k < nk; ++k) {
    V v[DP];
    for (int c = 0; c < DP; ++c) v[c] = vload(vp[k] + d0 + c * W);
    for (int r = 0; r < MR; ++r) {
      const V p = vsplat(Pt[k * Mp + r0 + r]);
      for (int c = 0; c < DP; ++c) acc[r][c] = vfma(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < DP; ++c) vstore(O + (r0 + r) * D + d0 + c * W, acc[r][c]);
}

template <int DP>
void tile_values_panel(const float* Pt, int Mp, int M, const float* const* vp, int nk, int d0,
                       const float* alpha, float* O, int D) {
  int r = 0;
  for (; r + kValueRows <= M; r += kValueRows)
    tile_values_block<kValueRows, DP>(Pt, Mp, r, vp, nk, d0, alpha, O, D);
  for (int left = M - r; left > 0; left = M - r) {
    if (left >= 4 && kValueRows > 4) {
      tile_values_block<4, DP>(Pt, Mp, r, vp, nk, d0, alpha, O, D);
      r += 4;
    } else if (left >= 2) {
      tile_values_block<2, DP>(Pt, Mp, r, vp, nk, d0, alpha, O, D);
      r += 2;
    } else {
      tile_values_block<1, DP>(Pt, Mp, r, vp, nk, d0, alpha, O, D);
      r += 1;
    }
  }
}

void tile_values(const float* Pt, int Mp, int M, const float* const* vp, int nk,
                 const float* alpha, float* O, int D) {
  const int vectors = D / W;
  int d0 = 0;
  for (int c = 0; c < vectors;) {
    const int dp = std::min(vectors - c, kValuePanel);
    switch (dp) {
      case 4: tile_values_panel<4>(Pt, Mp, M, vp, nk, d0, alpha, O, D); break;
      case 3: tile_values_panel<3>(Pt, Mp, M, vp, nk, d0, alpha, O, D); break;
      case 2: tile_values_panel<2>(Pt, Mp, M, vp, nk, d0, alpha, O, D); break;
      default: tile_values_panel<1>(Pt, Mp, M, vp, nk, d0, alpha, O, D); break;
    }
    c += dp;
    d0 += dp * W;
  }
}

// Key rows of a chunk as fp32 pointers: the cache's own rows (fp32), or converted into buf (fp16).
inline const float* const* float_rows(const float* const* rows, int, float*, int, const float**) {
  return rows;
}
inline const float* const* float_rows(const uint16_t* const* rows, int nk, float* buf, int D,
                                      const float** out) {
  for (int k = 0; k < nk; ++k) {
    load_row(rows[k], buf + k * D, D);
    out[k] = buf + k * D;
  }
  return out;
}

template <class T, class TKV>
void tile_item(const Job& J, const Item& it) {
  const int D = static_cast<int>(J.D), G = J.G;
  const int M = (it.q1 - it.q0) * G, Mp = (M + W - 1) / W * W, vectors = Mp / W;
  const int64_t first = J.row_start[it.b] + it.q0, last = J.row_start[it.b] + it.q1 - 1;
  const int64_t lo = J.window > 0 ? std::max<int64_t>(0, first - J.window + 1) : 0;
  float* Qt = Scratch::get(tls.q, static_cast<size_t>(D) * Mp + D);  // (D, Mp) + one row
  float* St = Scratch::get(tls.st, static_cast<size_t>(kChunk) * Mp);  // (kChunk, Mp)
  float* O = Scratch::get(tls.o, static_cast<size_t>(M) * D);          // (M, D)
  float* m = Scratch::get(tls.m, static_cast<size_t>(Mp));
  float* l = Scratch::get(tls.l, static_cast<size_t>(Mp));
  float* alpha = Scratch::get(tls.alpha, static_cast<size_t>(Mp));
  float* kbuf = Scratch::get(tls.kbuf, static_cast<size_t>(kChunk) * D);
  float* vbuf = Scratch::get(tls.vbuf, static_cast<size_t>(kChunk) * D);
  const TKV** kp = reinterpret_cast<const TKV**>(Scratch::get(tls.kp, kChunk));
  const TKV** vp = reinterpret_cast<const TKV**>(Scratch::get(tls.vp, kChunk));
  float* row = Qt + static_cast<size_t>(D) * Mp;
  for (int r = 0; r < Mp; ++r) {  // Q' (D, Mp); padding rows repeat the last real row
    if (r < M) load_query<T>(J, it, r, row);
    for (int d = 0; d < D; ++d) Qt[d * Mp + r] = row[d];
  }
  int32_t* rowpos = Scratch::get(tls.rowpos, static_cast<size_t>(Mp));
  for (int r = 0; r < Mp; ++r)  // each lane's query position (padding: the last row's)
    rowpos[r] = static_cast<int32_t>(first + std::min(r, M - 1) / G);
  for (int r = 0; r < Mp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::fill(O, O + static_cast<size_t>(M) * D, 0.f);
  const VI window = VI{} + static_cast<int32_t>(J.window > 0 ? J.window : (int64_t{1} << 30));
  for (int64_t c = lo; c <= last; c += kChunk) {
    const int nk = static_cast<int>(std::min<int64_t>(kChunk, last + 1 - c));
    gather_rows(J, it, static_cast<const TKV*>(J.key_out), c, nk, kp);
    gather_rows(J, it, static_cast<const TKV*>(J.value_out), c, nk, vp);
    const float* const* kf = float_rows(kp, nk, kbuf, D, Scratch::get(tls.kf, kChunk));
    const float* const* vf = float_rows(vp, nk, vbuf, D, Scratch::get(tls.vf, kChunk));
    tile_scores(kf, nk, Qt, Mp, D, St);
    // some lane masks a key of this chunk: the causal edge (keys after the first query) or the
    // window's (keys at or before the last query's p - window)
    const bool masked = c + nk - 1 > first || (J.window > 0 && c <= last - J.window);
    for (int v = 0; v < vectors; ++v) {
      float* col = St + v * W;  // this vector of rows, key k at col + k * Mp
      V mx[4] = {vsplat(-INFINITY), vsplat(-INFINITY), vsplat(-INFINITY), vsplat(-INFINITY)};
      if (J.softcap > 0.f || masked) {
        VI pos;
        __builtin_memcpy(&pos, rowpos + v * W, sizeof pos);
        for (int k = 0; k < nk; ++k) {
          V x = vload(col + k * Mp);
          if (J.softcap > 0.f) x = vsoftcap(x, J.softcap);
          if (masked) {
            const VI key = VI{} + static_cast<int32_t>(c + k);
            x = vselect((key <= pos) & (key > pos - window), x, vsplat(-INFINITY));
          }
          vstore(col + k * Mp, x);
          mx[k & 3] = vmax(mx[k & 3], x);
        }
      } else {
        for (int k = 0; k < nk; ++k) mx[k & 3] = vmax(mx[k & 3], vload(col + k * Mp));
      }
      const V m_old = vload(m + v * W), m_new = vmax(m_old, vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3])));
      const V m_use = vselect(m_new == vsplat(-INFINITY), V{}, m_new);  // all masked so far
      const V a = vexp(m_old - m_use);
      V sum[2] = {V{}, V{}};
      for (int k = 0; k < nk; ++k) {
        const V p = vexp(vload(col + k * Mp) - m_use);
        vstore(col + k * Mp, p);
        sum[k & 1] += p;
      }
      vstore(m + v * W, m_new);
      vstore(l + v * W, vload(l + v * W) * a + (sum[0] + sum[1]));
      vstore(alpha + v * W, a);
    }
    tile_values(St, Mp, M, vf, nk, alpha, O, D);
  }
  for (int r = 0; r < M; ++r) store_output<T>(J, it, r, O + r * D, 1.f / l[r]);
}

// ---------------------------------------------------------------------------------------------
// entry points (ParallelFor callbacks)

template <class T, class TKV>
void write_batch(void* job, size_t i) {
  const Job& J = *static_cast<const Job*>(job);
  const int64_t per = (J.N + J.write_batches - 1) / J.write_batches;
  const int64_t n0 = static_cast<int64_t>(i) * per;
  write_tokens<T, TKV>(J, n0, std::min(J.N, n0 + per));
}

template <class T, class TKV>
void attend(void* job, size_t i) {
  const Job& J = *static_cast<const Job*>(job);
  const Item& it = J.items[i];
  if ((it.q1 - it.q0) * J.G <= kSmallRows)
    small_item<T, TKV>(J, it);
  else
    tile_item<T, TKV>(J, it);
}

inline Kernels kernels(bool t_half, bool kv_half) {
  if (t_half)
    return {&write_batch<uint16_t, uint16_t>, &attend<uint16_t, uint16_t>, &merge_split<uint16_t>, W,
            kSmallRows, kScorePanel};
  if (kv_half)
    return {&write_batch<float, uint16_t>, &attend<float, uint16_t>, &merge_split<float>, W, kSmallRows,
            kScorePanel};
  return {&write_batch<float, float>, &attend<float, float>, &merge_split<float>, W, kSmallRows, kScorePanel};
}
