// The kernels' write phase and small path (few query rows per KV head: decode). Scores of W
// keys at a time for each query row (W dot products, one transpose-add tree: keys in lanes),
// the row's softmax over its whole visible range, then the values with the rows' outputs in
// registers; long rows may be split between items and merged (flash-decoding).
// Not a translation unit of its own: paged_attention.cc includes it once per instruction set,
// inside namespace isa_<name> and under that set's target pragma, with IF_ISA (0 portable,
// 1 AVX2+FMA+F16C, 2 AVX-512F/BW/DQ/VL) and IF_W (float lanes per vector: 4, 8, 16) defined.

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
