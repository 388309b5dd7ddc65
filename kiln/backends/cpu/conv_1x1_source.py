"""The C source of kiln's AVX-512 and AVX2 kernels for 1x1 stride-1 convolutions of channels-last
inputs (:mod:`.conv` documents the kinds), part of :data:`.conv_source.SOURCE` (after the
GEMM convolution's helpers, whose ``kiln_conv_gemm_f32`` calls it).

Such a convolution is the GEMM ``out[M][Cout] = x[M][C] @ W[C][Cout]`` with the input itself
as A.  In a MobileNet-style net its K (the input channels, 16-96) and its N (the output
channels, 16-96 for half the layers) are small: a blocked GEMM that stores each tile and
then passes over it again for the epilogue spends as much time on stores, reloads and tile
edges as on FMAs.  This kernel keeps one block of rows x up to 64 output channels in
registers for the whole reduction and applies ``act(acc + bias + residual)`` to the
registers before the only store (masked for the channel tail), so a block's result is
written once.  Rows per block follow the block's width (12 rows of 16 or 32 channels, 8 of
48, 6 of 64: 12-24 accumulators, each broadcast of an input value feeding 1-4 FMAs).
Each thread takes a range of rows with all their channels.  With AVX2's 16 registers a block
is 6 rows x one 16-channel panel (12 accumulators), a thread walking four panels at a time
over its blocks of rows."""

from __future__ import annotations

PW_SOURCE = r"""
/* ------------------------------------------------------------------ 1x1, in place, AVX-512 */
#ifdef KMG_AVX512
/* c[R rows][16 NV] = act(a[R rows][K] @ B + bias + res), B in 16-column panels (panel v at
   bp + v * pstride, row k at + k * 16); rows past `rows` read row 0 again and are not stored;
   the last vector's columns masked by mlast */
static inline __attribute__((always_inline)) void kcp_block(
    const float *a, long lda, long rows, long K, const float *bp, long pstride, const float *bias,
    const float *res, float *c, long ldc, int act, __mmask16 mlast, const int NV, const int R) {
  __m512 acc[12][4];
  const float *ar[12];
  _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) ar[r] = a + (r < rows ? r : 0) * lda;
  _Pragma("GCC unroll 12") for (int r = 0; r < R; r++)
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
  for (long k = 0; k < K; k++) {
    __m512 b[4];
    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) b[v] = _mm512_loadu_ps(bp + v * pstride + k * 16);
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {
      __m512 x = _mm512_set1_ps(ar[r][k]);
      _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(x, b[v], acc[r][v]);
    }
  }
  _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {
    __mmask16 m = v == NV - 1 ? mlast : (__mmask16)0xFFFF;
    __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + v * 16) : _mm512_setzero_ps();
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {
      if (r >= rows) break;
      __m512 y = _mm512_add_ps(acc[r][v], bv);
      if (res) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, res + r * ldc + v * 16));
      _mm512_mask_storeu_ps(c + r * ldc + v * 16, m, kcv_act16(y, act));
    }
  }
}

/* rows per block of a block nv vectors wide: 12-24 accumulators */
static inline long kcp_rows_of(long nv) { return nv == 4 ? 6 : nv == 3 ? 8 : 12; }

/* one block: the rows [m, m + R) (fewer where m_end comes first) x the columns [n0, n0 + 16 nv) */
static void kcp_one(const kcg_t *g, long m, long m_end, long n0, long nv) {
  long C = g->C, K = g->K, Cout = g->Cout, pstride = K * KMG_NR, R = kcp_rows_of(nv);
  long tail = Cout - (n0 + 16 * (nv - 1)), rows = m_end - m < R ? m_end - m : R;
  __mmask16 mlast = tail >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << tail) - 1u);
  const float *bp = g->Bp + (n0 / KMG_NR) * pstride, *bias = g->bias ? g->bias + n0 : 0;
  const float *a = g->x + m * C, *res = g->res ? g->res + m * Cout + n0 : 0;
  float *c = g->out + m * Cout + n0;
  switch (nv) {
    case 4: kcp_block(a, C, rows, K, bp, pstride, bias, res, c, Cout, g->act, mlast, 4, 6); break;
    case 3: kcp_block(a, C, rows, K, bp, pstride, bias, res, c, Cout, g->act, mlast, 3, 8); break;
    case 2: kcp_block(a, C, rows, K, bp, pstride, bias, res, c, Cout, g->act, mlast, 2, 12); break;
    default: kcp_block(a, C, rows, K, bp, pstride, bias, res, c, Cout, g->act, mlast, 1, 12); break;
  }
}

/* the whole convolution: each thread a range of rows (a multiple of 6), all their channels --
   so the next layer, split by rows too, reads what its own thread wrote (a split by channel
   chunks made the depthwise convolution after it 2-3x slower in the model: every pixel's
   channels came from both cores) -- chunk by chunk of 64 channels (the chunk's weight panels
   stay in L1), then block by block of rows */
static int kcp_inplace(const kcg_t *g, int nthreads) {
  long M = g->M, vectors = (g->Cout + 15) / 16, chunks = (vectors + 3) / 4;
  #pragma omp parallel num_threads(nthreads)
  {
#ifdef _OPENMP
    long t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    long t = 0, T = 1;
#endif
    long share = ((M + T - 1) / T + 5) / 6 * 6;
    long lo = t * share, hi = lo + share < M ? lo + share : M;
    for (long ch = 0; ch < chunks; ch++) {
      long nv = vectors - 4 * ch < 4 ? vectors - 4 * ch : 4, R = kcp_rows_of(nv);
      for (long m = lo; m < hi; m += R) kcp_one(g, m, hi, 64 * ch, nv);
    }
  }
  return 0;
}
#elif defined(KMG_AVX2)
/* ------------------------------------------------------------------ 1x1, in place, AVX2 */
/* AVX2 has 16 registers: a block is 6 rows x one 16-column panel (12 accumulators, two B
   vectors, one broadcast), and a thread walks a chunk of four panels (their weights stay in
   L1) block of rows by block of rows, each row block's A (6 x K) read from L1 for the four
   panels.  The epilogue runs on the registers; the store of a partial panel is masked. */
/* c[rows][w] = act(a[rows][K] @ panel + bias + res), rows <= 6 (rows past `rows` read row 0
   again and are not stored), w <= 16 columns */
static void kcp_tile8(const float *a, long lda, long rows, long K, const float *bp, const float *bias,
                      const float *res, float *c, long ldc, int act, long w) {
  const float *ar[6];
  __m256 acc[6][2];
  _Pragma("GCC unroll 6") for (int r = 0; r < 6; r++) {
    ar[r] = a + (r < rows ? r : 0) * lda;
    acc[r][0] = _mm256_setzero_ps(); acc[r][1] = _mm256_setzero_ps();
  }
  _Pragma("GCC unroll 2") for (long k = 0; k < K; k++) {
    __m256 b0 = _mm256_loadu_ps(bp + k * KMG_NR), b1 = _mm256_loadu_ps(bp + k * KMG_NR + 8);
    _Pragma("GCC unroll 6") for (int r = 0; r < 6; r++) {
      __m256 x = _mm256_broadcast_ss(ar[r] + k);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  __m256i m0 = kcv_mask8(w), m1 = kcv_mask8(w - 8);
  _Pragma("GCC unroll 6") for (int r = 0; r < 6; r++) {
    if (r >= rows) break;
    const float *rr = res ? res + r * ldc : 0;
    kcv_store8(acc[r][0], c + r * ldc, bias, rr, act, w, m0);
    kcv_store8(acc[r][1], c + r * ldc + 8, bias ? bias + 8 : 0, rr ? rr + 8 : 0, act, w - 8, m1);
  }
}

/* the whole convolution: each thread a range of rows (a multiple of 6), all their channels
   (why: the AVX-512 kernel's note), chunk by chunk of four panels, then block by block of rows */
static int kcp_inplace(const kcg_t *g, int nthreads) {
  long M = g->M, C = g->C, K = g->K, Cout = g->Cout, panels = g->panels, pstride = K * KMG_NR;
  #pragma omp parallel num_threads(nthreads)
  {
#ifdef _OPENMP
    long t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    long t = 0, T = 1;
#endif
    long share = ((M + T - 1) / T + 5) / 6 * 6;
    long lo = t * share, hi = lo + share < M ? lo + share : M;
    for (long p0 = 0; p0 < panels; p0 += 4)
      for (long m = lo; m < hi; m += 6) {
        long rows = hi - m < 6 ? hi - m : 6;
        for (long p = p0; p < p0 + 4 && p < panels; p++) {
          long n0 = p * KMG_NR, w = Cout - n0 < KMG_NR ? Cout - n0 : KMG_NR;
          kcp_tile8(g->x + m * C, C, rows, K, g->Bp + p * pstride, g->bias ? g->bias + n0 : 0,
                    g->res ? g->res + m * Cout + n0 : 0, g->out + m * Cout + n0, Cout, g->act, w);
        }
      }
  }
  return 0;
}
#endif
"""

__all__ = ["PW_SOURCE"]
