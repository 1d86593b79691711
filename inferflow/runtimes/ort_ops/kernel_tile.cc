// The kernels' tile path (prefill chunks) and entry points. A tile of query tokens x G rows in
// lanes; key chunks of kChunk keys: S' (keys x rows) = K Q' by outer products (no horizontal
// sums), online softmax per row (flash attention), O (rows x D) += P V by outer products.
// Not a translation unit of its own: paged_attention.cc includes it once per instruction set,
// inside namespace isa_<name> and under that set's target pragma, with IF_ISA (0 portable,
// 1 AVX2+FMA+F16C, 2 AVX-512F/BW/DQ/VL) and IF_W (float lanes per vector: 4, 8, 16) defined.

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
