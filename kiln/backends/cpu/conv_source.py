"""The C source of kiln's 2-d convolution kernels (:mod:`.conv` documents them): the
post-op epilogue they share, the implicit GEMM on :mod:`.microgemm`'s micro-kernels (its C
source is included), the depthwise kernel (:mod:`.conv_dw_source`) and the direct kernel
for few input channels, all behind one entry, ``kiln_conv_k``, taking its sizes and operand
pointers in one array each."""

from __future__ import annotations

from . import microgemm
from .conv_1x1_source import PW_SOURCE
from .conv_dw_source import DW_SOURCE

_GEMM = r"""
/* ------------------------------------------------------------------ post-ops */
/* The epilogue of every kernel, on a value still in registers: y = act(acc + bias + residual),
   act 0 none, 1 relu, 2 relu6, 3 hardswish (y * min(max(y + 3, 0), 6) / 6, torch's order, with
   the division a multiplication by 1/6: within an ulp of torch's, and a vector division costs
   as much as the 1x1 kernel's whole reduction at 16 input channels). */
static inline float kcv_act1(float y, int act) {
  if (act == 1) return y > 0.0f ? y : 0.0f;
  if (act == 2) return y > 0.0f ? (y < 6.0f ? y : 6.0f) : 0.0f;
  if (act == 3) { float t = y + 3.0f; t = t > 0.0f ? (t < 6.0f ? t : 6.0f) : 0.0f; return y * t / 6.0f; }
  return y;
}
#ifdef KMG_AVX512
static inline __m512 kcv_act16(__m512 y, int act) {
  if (act == 0) return y;
  __m512 z = _mm512_setzero_ps(), six = _mm512_set1_ps(6.0f);
  if (act == 1) return _mm512_max_ps(y, z);
  if (act == 2) return _mm512_min_ps(_mm512_max_ps(y, z), six);
  __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(y, _mm512_set1_ps(3.0f)), z), six);
  return _mm512_mul_ps(_mm512_mul_ps(y, t), _mm512_set1_ps(1.0f / 6.0f));
}
#endif
#ifdef KMG_AVX2
static inline __m256 kcv_act8(__m256 y, int act) {
  if (act == 0) return y;
  __m256 z = _mm256_setzero_ps(), six = _mm256_set1_ps(6.0f);
  if (act == 1) return _mm256_max_ps(y, z);
  if (act == 2) return _mm256_min_ps(_mm256_max_ps(y, z), six);
  __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(y, _mm256_set1_ps(3.0f)), z), six);
  return _mm256_mul_ps(_mm256_mul_ps(y, t), _mm256_set1_ps(1.0f / 6.0f));
}
/* lanes [0, w) of an 8-wide vector (w <= 0: none), for a masked load or store */
static inline __m256i kcv_mask8(long w) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)w), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* c[0..w) = act(y + bias + res) for the w <= 8 lanes of one register (m = kcv_mask8(w)); bias
   and res optional; w <= 0 stores nothing */
static inline __attribute__((always_inline)) void kcv_store8(__m256 y, float *c, const float *bias, const float *res,
                                                              int act, long w, __m256i m) {
  if (w >= 8) {
    if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias));
    if (res) y = _mm256_add_ps(y, _mm256_loadu_ps(res));
    _mm256_storeu_ps(c, kcv_act8(y, act));
  } else if (w > 0) {
    if (bias) y = _mm256_add_ps(y, _mm256_maskload_ps(bias, m));
    if (res) y = _mm256_add_ps(y, _mm256_maskload_ps(res, m));
    _mm256_maskstore_ps(c, m, kcv_act8(y, act));
  }
}
#endif
/* c[0..w) = act(c + bias[0..w) + res[0..w)), bias and res optional: one row of a tile, in cache */
static inline void kcv_post_row(float *c, const float *bias, const float *res, long w, int act) {
  long j = 0;
#ifdef KMG_AVX512
  for (; j < w; j += 16) {
    __mmask16 m = w - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (w - j)) - 1u);
    __m512 y = _mm512_maskz_loadu_ps(m, c + j);
    if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, bias + j));
    if (res) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, res + j));
    _mm512_mask_storeu_ps(c + j, m, kcv_act16(y, act));
  }
#elif defined(KMG_AVX2)
  for (; j + 8 <= w; j += 8) {
    __m256 y = _mm256_loadu_ps(c + j);
    if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + j));
    if (res) y = _mm256_add_ps(y, _mm256_loadu_ps(res + j));
    _mm256_storeu_ps(c + j, kcv_act8(y, act));
  }
#endif
  for (; j < w; j++) c[j] = kcv_act1(c[j] + (bias ? bias[j] : 0.0f) + (res ? res[j] : 0.0f), act);
}

/* ------------------------------------------------------------------ unpacked A, plain C */
/* c[rows][w] (row stride ldc) (+)= A[rows][kc] @ Bp[kc][16] with A read in place (row stride
   lda): the 1x1 stride-1 convolution of a channels-last input, whose A is the input itself.
   With AVX2 or AVX-512 such a convolution runs kcp_inplace (conv_1x1_source.py) instead. */
#ifndef KMG_AVX2
static void kcd_tile(long kc, const float *a, long lda, long rows, const float *bp, float *c, long ldc, int acc,
                     long w) {
  for (long r = 0; r < rows; r++)
    for (long j = 0; j < w; j++) {
      float sum = acc ? c[r * ldc + j] : 0.0f;
      for (long k = 0; k < kc; k++) sum += a[r * lda + k] * bp[k * KMG_NR + j];
      c[r * ldc + j] = sum;
    }
}
#endif

/* ------------------------------------------------------------------ convolution as GEMM */
/* One convolution as a GEMM: out[M][Cout] (+ bias) = A @ Bp, A never stored (see kcg_pack) */
typedef struct {
  long N, C, H, W, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, xn, xc, xh, xw, M, K, Cout, panels;
  const float *x, *Bp, *bias, *res;
  float *out;
  int checks, inplace, act;
} kcg_t;
#ifdef KMG_AVX2
static int kcp_inplace(const kcg_t *g, int nthreads); /* conv_1x1_source.py */
#endif

/* the k -> (c, kh, kw) tables of the K block starting at pc, entries [k0, k1) */
static inline void kcg_koff(const kcg_t *g, long pc, long k0, long k1, long *koff, long *kdh, long *kdw) {
  for (long k = k0; k < k1; k++) {
    long kk = pc + k, c = kk / (g->KH * g->KW), kh = (kk / g->KW) % g->KH, kw = kk % g->KW;
    kdh[k] = kh * g->dh; kdw[k] = kw * g->dw;
    koff[k] = c * g->xc + kh * g->dh * g->xh + kw * g->dw * g->xw;
  }
}

/* micro-panel ib of the rows [ic, ic + mc), K block [pc, pc + kc), into dst: the input windows
   read directly (zeros where padding is read) */
static inline void kcg_pack(const kcg_t *g, long ic, long mc, long ib, long kc, const long *koff, const long *kdh,
                            const long *kdw, float *dst) {
  long rows = mc - ib * KMG_MR < KMG_MR ? mc - ib * KMG_MR : KMG_MR;
  long base[KMG_MR], ih0[KMG_MR], iw0[KMG_MR];
  for (long r = 0; r < rows; r++) {
    long m = ic + ib * KMG_MR + r, n = m / (g->OH * g->OW), oh = (m / g->OW) % g->OH, ow = m % g->OW;
    ih0[r] = oh * g->sh - g->ph; iw0[r] = ow * g->sw - g->pw;
    base[r] = n * g->xn + ih0[r] * g->xh + iw0[r] * g->xw;
  }
  for (long k = 0; k < kc; k++) {
    float *d = dst + k * KMG_MR;
    long off = koff[k];
    if (!g->checks) {
      for (long r = 0; r < rows; r++) d[r] = g->x[base[r] + off];
    } else {
      for (long r = 0; r < rows; r++) {
        long ih = ih0[r] + kdh[k], iw = iw0[r] + kdw[k];
        d[r] = (ih >= 0 && ih < g->H && iw >= 0 && iw < g->W) ? g->x[base[r] + off] : 0.0f;
      }
    }
    for (long r = rows; r < KMG_MR; r++) d[r] = 0.0f;
  }
}

/* the tiles of unit u (KMG_STEP panels) and micro-panel ib (packed at ap, unless in place) of
   the rows [ic, ic + mc), K block [pc, pc + kc); the epilogue (bias, residual, activation)
   after the last block only, on each tile right after its last store */
static inline void kcg_unit(const kcg_t *g, long ic, long mc, long ib, long u, long pc, long kc, const float *ap) {
  long K = g->K, Cout = g->Cout, panels = g->panels;
  long m0 = ic + ib * KMG_MR, rows = mc - ib * KMG_MR < KMG_MR ? mc - ib * KMG_MR : KMG_MR;
  int last = pc + kc >= K;
  for (long p = u * KMG_STEP; p < panels && p < (u + 1) * KMG_STEP;) {
    const float *bp = g->Bp + p * K * KMG_NR + pc * KMG_NR;
    long n0 = p * KMG_NR, w = Cout - n0 < KMG_NR ? Cout - n0 : KMG_NR;
    float *c = g->out + m0 * Cout + n0;
#ifdef KMG_PAIRS
    if (p + 1 < panels && Cout - (p + 1) * KMG_NR >= KMG_NR) {
      kmg_pair(rows, kc, ap, bp, bp + K * KMG_NR, c, Cout, pc > 0);
      w = 2 * KMG_NR;
    } else
#endif
#ifndef KMG_AVX2
    if (g->inplace) kcd_tile(kc, g->x + m0 * g->C + pc, g->C, rows, bp, c, Cout, pc > 0, w);
    else
#endif
    if (w == KMG_NR) kmg_tile(rows, kc, ap, bp, c, Cout, pc > 0);
    else kmg_edge(kc, ap, bp, c, Cout, pc > 0, rows, w);
    if (last && (g->bias || g->res || g->act))
      for (long r = 0; r < rows; r++)
        kcv_post_row(c + r * Cout, g->bias ? g->bias + n0 : 0, g->res ? g->res + (m0 + r) * Cout + n0 : 0, w,
                     g->act);
    p += w > KMG_NR ? 2 : 1;
  }
}

/* scratch of one thread: a packed block of A and the k tables of one K block */
typedef struct { float *work; long *koff, *kdh, *kdw; } kcg_scratch;

static int kcg_alloc(kcg_scratch *s, long mc_rounded, long kc_max) {
  s->work = (float *)aligned_alloc(64, sizeof(float) * (size_t)(mc_rounded * kc_max));
  s->koff = (long *)malloc(sizeof(long) * (size_t)kc_max);
  s->kdh = (long *)malloc(sizeof(long) * (size_t)kc_max);
  s->kdw = (long *)malloc(sizeof(long) * (size_t)kc_max);
  return s->work && s->koff && s->kdh && s->kdw;
}

static void kcg_free(kcg_scratch *s) { free(s->work); free(s->koff); free(s->kdh); free(s->kdw); }

/* the rows [m_lo, m_hi) by one thread, with its own scratch */
static void kcg_rows(const kcg_t *g, long m_lo, long m_hi, kcg_scratch *s) {
  long units = (g->panels + KMG_STEP - 1) / KMG_STEP;
  for (long pc = 0; pc < g->K; pc += KMG_KC) {
    long kc = g->K - pc < KMG_KC ? g->K - pc : KMG_KC;
    kcg_koff(g, pc, 0, kc, s->koff, s->kdh, s->kdw);
    for (long ic = m_lo; ic < m_hi; ic += KMG_MC) {
      long mc = m_hi - ic < KMG_MC ? m_hi - ic : KMG_MC, blocks = (mc + KMG_MR - 1) / KMG_MR;
      for (long ib = 0; ib < (g->inplace ? 0 : blocks); ib++)
        kcg_pack(g, ic, mc, ib, kc, s->koff, s->kdh, s->kdw, s->work + ib * KMG_MR * kc);
      for (long u = 0; u < units; u++)
        for (long ib = 0; ib < blocks; ib++) kcg_unit(g, ic, mc, ib, u, pc, kc, s->work + ib * KMG_MR * kc);
    }
  }
}

/* out[M][Cout] = act(A @ Bp + bias + res) with A(m, kk) = x[n, c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]
   (0 outside the input), m = (n, oh, ow), kk = (c, kh, kw); x's element (n,c,h,w) at
   x[n*xn + c*xc + h*xh + w*xw]; Bp: K x Cout in 16-column panels.  With at least two
   micro-panels of rows per thread and no more output channels than rows, each thread takes
   a range of rows with its own scratch (no barriers: the blocks of a small convolution are
   too short to share); else the threads share each block's (panel, micro-panel) grid.
   res (optional) is laid out like out.  Returns 1 without memory. */
int kiln_conv_gemm_f32(long N, long C, long H, long W, long OH, long OW, long KH, long KW,
                       long sh, long sw, long ph, long pw, long dh, long dw,
                       const float *x, long xn, long xc, long xh, long xw,
                       const float *Bp, long Cout, const float *bias, const float *res, int act, float *out,
                       int nthreads) {
  long M = N * OH * OW, K = C * KH * KW, panels = (Cout + KMG_NR - 1) / KMG_NR;
  if (M <= 0 || Cout <= 0) return 0;
  if (K <= 0) {
    for (long m = 0; m < M; m++)
      for (long j = 0; j < Cout; j++) out[m * Cout + j] = 0.0f;
    for (long m = 0; m < M; m++) kcv_post_row(out + m * Cout, bias, res ? res + m * Cout : 0, Cout, act);
    return 0;
  }
  int checks = ph > 0 || pw > 0;
  /* 1x1, stride 1, channels-last contiguous input: A is the input matrix [M][C] itself */
  int inplace = KH == 1 && KW == 1 && sh == 1 && sw == 1 && !checks && xc == 1 && xw == C && xh == W * C
                && (N == 1 || xn == H * W * C);
  kcg_t g = {N, C, H, W, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, xn, xc, xh, xw, M, K, Cout, panels,
             x, Bp, bias, res, out, checks, inplace, act};
#ifdef KMG_AVX2
  if (inplace) return kcp_inplace(&g, nthreads);
#endif
  long mc_max = M < KMG_MC ? M : KMG_MC, kc_max = K < KMG_KC ? K : KMG_KC;
  long mc_rounded = (mc_max + KMG_MR - 1) / KMG_MR * KMG_MR;
  int failed = 0;
  if (M >= 2L * KMG_MR * (nthreads > 1 ? nthreads : 1) && M >= Cout) {
    #pragma omp parallel num_threads(nthreads)
    {
#ifdef _OPENMP
      long t = omp_get_thread_num(), T = omp_get_num_threads();
#else
      long t = 0, T = 1;
#endif
      long share = ((M + T - 1) / T + KMG_MR - 1) / KMG_MR * KMG_MR;
      long lo = t * share, hi = lo + share < M ? lo + share : M;
      kcg_scratch s;
      if (!kcg_alloc(&s, mc_rounded, kc_max)) {
        #pragma omp atomic write
        failed = 1;
      } else if (lo < hi) {
        kcg_rows(&g, lo, hi, &s);
      }
      kcg_free(&s);
    }
    return failed;
  }
  kcg_scratch s;
  if (!kcg_alloc(&s, mc_rounded, kc_max)) { kcg_free(&s); return 1; }
  long units = (panels + KMG_STEP - 1) / KMG_STEP;
  #pragma omp parallel num_threads(nthreads)
  {
    for (long pc = 0; pc < K; pc += KMG_KC) {
      long kc = K - pc < KMG_KC ? K - pc : KMG_KC;
      #pragma omp single
      kcg_koff(&g, pc, 0, kc, s.koff, s.kdh, s.kdw);
      for (long ic = 0; ic < M; ic += KMG_MC) {
        long mc = M - ic < KMG_MC ? M - ic : KMG_MC, blocks = (mc + KMG_MR - 1) / KMG_MR;
        #pragma omp for schedule(static)
        for (long ib = 0; ib < (inplace ? 0 : blocks); ib++)
          kcg_pack(&g, ic, mc, ib, kc, s.koff, s.kdh, s.kdw, s.work + ib * KMG_MR * kc);
        #pragma omp for collapse(2) schedule(static)
        for (long u = 0; u < units; u++)
          for (long ib = 0; ib < blocks; ib++) kcg_unit(&g, ic, mc, ib, u, pc, kc, s.work + ib * KMG_MR * kc);
      }
    }
  }
  kcg_free(&s);
  return 0;
}

"""

_DIRECT = r"""
/* ------------------------------------------------------------------ few input channels */
#if defined(KMG_AVX2) && !defined(KMG_AVX512)
#define KDR_PX 6 /* AVX2: 6 pixels x 16 channels, twelve accumulators (FMA latency needs ten or more) */
#else
#define KDR_PX 8
#endif
#define KDR_CB 16
#ifdef KMG_AVX512
#define KDR_PX6 6
/* 6 output pixels (row oh, from ow) x 64 output channels of the direct convolution below, in
   24 accumulators: each input value is broadcast once against four weight vectors (with
   64 or more output channels; the 16-channel loop does the rest) */
static inline void kdr_block64(const float *xi, long xc, long xh, long xw, long H, long W, long C, long KH, long KW,
                               long oh, long ow, long OW, long sh, long sw, long ph, long pw, long dh, long dw,
                               const float *wt, long Cp, const float *bias, const float *rrow, int act, float *orow,
                               long Cout) {
  long px = OW - ow < KDR_PX6 ? OW - ow : KDR_PX6;
  __m512 acc[KDR_PX6][4];
  for (int v = 0; v < 4; v++) {
    __m512 b = bias ? _mm512_loadu_ps(bias + 16 * v) : _mm512_setzero_ps();
    for (int p = 0; p < KDR_PX6; p++) acc[p][v] = b;
  }
  for (long c = 0; c < C; c++) {
    for (long kh = 0; kh < KH; kh++) {
      long ih = oh * sh - ph + kh * dh;
      if (ih < 0 || ih >= H) continue;
      const float *xr = xi + c * xc + ih * xh;
      const float *wr = wt + (c * KH + kh) * KW * Cp;
      for (long kw = 0; kw < KW; kw++) {
        const float *wp = wr + kw * Cp;
        __m512 w0 = _mm512_loadu_ps(wp), w1 = _mm512_loadu_ps(wp + 16);
        __m512 w2 = _mm512_loadu_ps(wp + 32), w3 = _mm512_loadu_ps(wp + 48);
        long iw0 = ow * sw - pw + kw * dw;
        int inside = px == KDR_PX6 && iw0 >= 0 && iw0 + (KDR_PX6 - 1) * sw < W;
        for (int p = 0; p < KDR_PX6; p++) {
          long iw = iw0 + p * sw;
          if (!inside && (p >= px || iw < 0 || iw >= W)) continue;
          __m512 xv = _mm512_set1_ps(xr[iw * xw]);
          acc[p][0] = _mm512_fmadd_ps(xv, w0, acc[p][0]);
          acc[p][1] = _mm512_fmadd_ps(xv, w1, acc[p][1]);
          acc[p][2] = _mm512_fmadd_ps(xv, w2, acc[p][2]);
          acc[p][3] = _mm512_fmadd_ps(xv, w3, acc[p][3]);
        }
      }
    }
  }
  for (int p = 0; p < KDR_PX6; p++) {
    if (p >= px) break;
    float *o = orow + (ow + p) * Cout;
    for (int v = 0; v < 4; v++) {
      __m512 y = acc[p][v];
      if (rrow) y = _mm512_add_ps(y, _mm512_loadu_ps(rrow + (ow + p) * Cout + 16 * v));
      _mm512_storeu_ps(o + 16 * v, kcv_act16(y, act));
    }
  }
}
#endif

/* out[n,oh,ow,co] (NHWC) = act(bias[co] + sum_(c,kh,kw) x[n,c,ih,iw] wt[c][kh][kw][co] (0 outside
   the input) + res[n,oh,ow,co]), x's element (n,c,h,w) at x[n*xn + c*xc + h*xh + w*xw], wt's output channels padded
   with zeros to Cp (a multiple of 16): each input value is broadcast against 16 output
   channels, for 8 output pixels of a row at once (eight vector accumulators; with AVX-512,
   64 channels x 6 pixels at once first, kdr_block64).  For the stem of a CNN (3 input
   channels), where a GEMM's K is too short to pay for packing A. */
void kiln_conv_direct_f32(long N, long C, long H, long W, long OH, long OW, long KH, long KW,
                          long sh, long sw, long ph, long pw, long dh, long dw,
                          const float *x, long xn, long xc, long xh, long xw,
                          const float *wt, long Cout, const float *bias, const float *res, int act, float *out,
                          int nthreads) {
  long Cp = (Cout + KDR_CB - 1) / KDR_CB * KDR_CB;
  #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
  for (long n = 0; n < N; n++) {
    for (long oh = 0; oh < OH; oh++) {
      const float *xi = x + n * xn;
      float *orow = out + (n * OH + oh) * OW * Cout;
      const float *rrow = res ? res + (n * OH + oh) * OW * Cout : 0;
      long c64 = 0;
#ifdef KMG_AVX512
      c64 = Cout / 64 * 64;
      for (long c0 = 0; c0 < c64; c0 += 64)
        for (long ow = 0; ow < OW; ow += KDR_PX6) kdr_block64(xi, xc, xh, xw, H, W, C, KH, KW, oh, ow, OW, sh, sw,
                                                             ph, pw, dh, dw, wt + c0, Cp, bias ? bias + c0 : 0,
                                                             rrow ? rrow + c0 : 0, act, orow + c0, Cout);
#endif
      for (long ow = 0; ow < OW && c64 < Cout; ow += KDR_PX) {
        long px = OW - ow < KDR_PX ? OW - ow : KDR_PX;
        for (long c0 = c64; c0 < Cout; c0 += KDR_CB) {
          long cw = Cout - c0 < KDR_CB ? Cout - c0 : KDR_CB;
#ifdef KMG_AVX512
          __mmask16 m = (__mmask16)((1u << cw) - 1u);
          __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + c0) : _mm512_setzero_ps();
          __m512 a0 = b, a1 = b, a2 = b, a3 = b, a4 = b, a5 = b, a6 = b, a7 = b;
          for (long c = 0; c < C; c++) {
            for (long kh = 0; kh < KH; kh++) {
              long ih = oh * sh - ph + kh * dh;
              if (ih < 0 || ih >= H) continue;
              const float *xr = xi + c * xc + ih * xh;
              for (long kw = 0; kw < KW; kw++) {
                __m512 wv = _mm512_loadu_ps(wt + ((c * KH + kh) * KW + kw) * Cp + c0);
                long iw0 = ow * sw - pw + kw * dw;
                if (px == KDR_PX && iw0 >= 0 && iw0 + (KDR_PX - 1) * sw < W) {
#define KDR_FMA(P, A) A = _mm512_fmadd_ps(_mm512_set1_ps(xr[(iw0 + P * sw) * xw]), wv, A);
                  KDR_FMA(0, a0) KDR_FMA(1, a1) KDR_FMA(2, a2) KDR_FMA(3, a3)
                  KDR_FMA(4, a4) KDR_FMA(5, a5) KDR_FMA(6, a6) KDR_FMA(7, a7)
#undef KDR_FMA
                } else {
#define KDR_EDGE(P, A) { long iw = iw0 + P * sw; \
                  if (P < px && iw >= 0 && iw < W) A = _mm512_fmadd_ps(_mm512_set1_ps(xr[iw * xw]), wv, A); }
                  KDR_EDGE(0, a0) KDR_EDGE(1, a1) KDR_EDGE(2, a2) KDR_EDGE(3, a3)
                  KDR_EDGE(4, a4) KDR_EDGE(5, a5) KDR_EDGE(6, a6) KDR_EDGE(7, a7)
#undef KDR_EDGE
                }
              }
            }
          }
          float *o = orow + ow * Cout + c0;
          __m512 acc[KDR_PX] = {a0, a1, a2, a3, a4, a5, a6, a7};
          for (long p = 0; p < px; p++) {
            __m512 y = acc[p];
            if (rrow) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, rrow + (ow + p) * Cout + c0));
            _mm512_mask_storeu_ps(o + p * Cout, m, kcv_act16(y, act));
          }
#elif defined(KMG_AVX2)
          /* AVX2: 6 pixels x 16 channels in twelve accumulators */
          __m256i m0 = kcv_mask8(cw), m1 = kcv_mask8(cw - 8);
          __m256 b0 = bias ? _mm256_maskload_ps(bias + c0, m0) : _mm256_setzero_ps();
          __m256 b1 = bias ? _mm256_maskload_ps(bias + c0 + 8, m1) : _mm256_setzero_ps();
          __m256 acc[KDR_PX][2];
          _Pragma("GCC unroll 6") for (int p = 0; p < KDR_PX; p++) { acc[p][0] = b0; acc[p][1] = b1; }
          for (long c = 0; c < C; c++) {
            for (long kh = 0; kh < KH; kh++) {
              long ih = oh * sh - ph + kh * dh;
              if (ih < 0 || ih >= H) continue;
              const float *xr = xi + c * xc + ih * xh;
              const float *wr = wt + (c * KH + kh) * KW * Cp + c0;
              for (long kw = 0; kw < KW; kw++) {
                __m256 w0 = _mm256_loadu_ps(wr + kw * Cp), w1 = _mm256_loadu_ps(wr + kw * Cp + 8);
                long iw0 = ow * sw - pw + kw * dw;
                if (px == KDR_PX && iw0 >= 0 && iw0 + (KDR_PX - 1) * sw < W) {
                  const float *xp = xr + iw0 * xw;
                  long step = sw * xw;
                  _Pragma("GCC unroll 6") for (int p = 0; p < KDR_PX; p++) {
                    __m256 xv = _mm256_broadcast_ss(xp + p * step);
                    acc[p][0] = _mm256_fmadd_ps(xv, w0, acc[p][0]);
                    acc[p][1] = _mm256_fmadd_ps(xv, w1, acc[p][1]);
                  }
                } else {
                  _Pragma("GCC unroll 6") for (int p = 0; p < KDR_PX; p++) {
                    long iw = iw0 + p * sw;
                    if (p >= px || iw < 0 || iw >= W) continue;
                    __m256 xv = _mm256_broadcast_ss(xr + iw * xw);
                    acc[p][0] = _mm256_fmadd_ps(xv, w0, acc[p][0]);
                    acc[p][1] = _mm256_fmadd_ps(xv, w1, acc[p][1]);
                  }
                }
              }
            }
          }
          _Pragma("GCC unroll 6") for (int p = 0; p < KDR_PX; p++) {  /* constant indices: acc stays in registers */
            if (p >= px) break;
            float *o = orow + (ow + p) * Cout + c0;
            const float *r = rrow ? rrow + (ow + p) * Cout + c0 : 0;
            kcv_store8(acc[p][0], o, 0, r, act, cw, m0);
            kcv_store8(acc[p][1], o + 8, 0, r ? r + 8 : 0, act, cw - 8, m1);
          }
#else
          float acc[KDR_PX][KDR_CB];
          for (long p = 0; p < KDR_PX; p++)
            for (long j = 0; j < KDR_CB; j++) acc[p][j] = bias && j < cw ? bias[c0 + j] : 0.0f;
          for (long c = 0; c < C; c++) {
            for (long kh = 0; kh < KH; kh++) {
              long ih = oh * sh - ph + kh * dh;
              if (ih < 0 || ih >= H) continue;
              const float *xr = xi + c * xc + ih * xh;
              for (long kw = 0; kw < KW; kw++) {
                const float *wp = wt + ((c * KH + kh) * KW + kw) * Cp + c0;
                long iw0 = ow * sw - pw + kw * dw;
                float v[KDR_PX];
                for (long p = 0; p < KDR_PX; p++) {
                  long iw = iw0 + p * sw;
                  v[p] = (p < px && iw >= 0 && iw < W) ? xr[iw * xw] : 0.0f;
                }
                for (long p = 0; p < KDR_PX; p++)
                  #pragma omp simd
                  for (long j = 0; j < KDR_CB; j++) acc[p][j] += v[p] * wp[j];
              }
            }
          }
          for (long p = 0; p < px; p++)
            for (long j = 0; j < cw; j++)
              orow[(ow + p) * Cout + c0 + j] =
                  kcv_act1(acc[p][j] + (rrow ? rrow[(ow + p) * Cout + c0 + j] : 0.0f), act);
#endif
        }
      }
    }
  }
}

/* ------------------------------------------------------------------ the entry */
long kiln_conv_failures = 0;

/* One convolution of any kind, the operands in one pointer array (what generated code calls
   through its function table; it touches nothing of Python):
   p[0] = const long g[]: g[0] kind (0 gemm, 1 depthwise, 2 direct), g[1] act (0 none, 1 relu,
          2 relu6, 3 hardswish), g[2] flags (bit 0: bias, bit 1: residual), g[3] threads, then the
          kind's sizes s = g + 4: N C H W OH OW KH KW sh sw ph pw dh dw, then x's strides
          (n c h w) and Cout (gemm, direct) or x's strides (n h w) (depthwise: channels unit-stride);
   p[1] x, p[2] the packed weight, p[3] bias, p[4] residual (NHWC, like out), p[5] out (NHWC).
   A GEMM without memory for its scratch writes NaN and counts one in kiln_conv_failures. */
void kiln_conv_k(void *const *p) {
  const long *g = (const long *)p[0], *s = g + 4;
  int act = (int)g[1], T = (int)g[3];
  const float *x = (const float *)p[1], *wt = (const float *)p[2];
  const float *bias = (g[2] & 1) ? (const float *)p[3] : 0, *res = (g[2] & 2) ? (const float *)p[4] : 0;
  float *out = (float *)p[5];
  if (g[0] == 1) {
    kiln_conv_dw_f32(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], s[12], s[13],
                     x, s[14], s[15], s[16], wt, bias, res, act, out, T);
  } else if (g[0] == 2) {
    kiln_conv_direct_f32(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], s[12], s[13],
                         x, s[14], s[15], s[16], s[17], wt, s[18], bias, res, act, out, T);
  } else if (kiln_conv_gemm_f32(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], s[12],
                                s[13], x, s[14], s[15], s[16], s[17], wt, s[18], bias, res, act, out, T)) {
    long total = s[0] * s[4] * s[5] * s[18];
    for (long i = 0; i < total; i++) out[i] = __builtin_nanf("");
    #pragma omp atomic
    kiln_conv_failures++;
  }
}
"""

SOURCE = microgemm.SOURCE + _GEMM + PW_SOURCE + DW_SOURCE + _DIRECT

__all__ = ["SOURCE"]
