"""The C source of kiln's depthwise convolution kernel (:mod:`.conv` documents it), part of
:data:`.conv_source.SOURCE` (after its post-op helpers ``kcv_act*``, before the entry)."""

from __future__ import annotations

DW_SOURCE = r"""
/* ------------------------------------------------------------------ depthwise */
/* kdw_block: acc[p][0..cw) = bias + sum over the taps of x(pixel p)[c0..] * w[c0..] for a block
   of up to KDW_PX output pixels of one row and up to KDW_CW channels (cw), then the epilogue
   (residual, activation) and the store.  Compile-time variants: `full` (cw = KDW_CW, no
   channel masks), `inside` (every tap of every pixel inside the row: no bounds checks) and
   `allpx` (px = KDW_PX). */
#ifdef KMG_AVX512
/* AVX-512: 8 pixels x 16 channels, eight 16-wide accumulators, a masked channel tail */
#define KDW_PX 8
#define KDW_CW 16
static inline __attribute__((always_inline)) void kdw_block(
    const float *xi, long xh, long xw, const float *wt, long C, long c0, long cw, const float *bias,
    const float *rrow, int act, long H, long W, long KH, long KW, long sw, long pw, long dh, long dw,
    long ih0, long ow, long px, float *orow, const int full, const int inside, const int allpx) {
  __mmask16 m = full ? (__mmask16)0xFFFF : (__mmask16)((1u << cw) - 1u);
#define KDW_LOAD(p) (full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p))
  __m512 b = bias ? KDW_LOAD(bias + c0) : _mm512_setzero_ps();
  __m512 a0 = b, a1 = b, a2 = b, a3 = b, a4 = b, a5 = b, a6 = b, a7 = b;
  for (long kh = 0; kh < KH; kh++) {
    long ih = ih0 + kh * dh;
    if (ih < 0 || ih >= H) continue;
    const float *xr = xi + ih * xh + c0;
    for (long kw = 0; kw < KW; kw++) {
      __m512 wv = KDW_LOAD(wt + (kh * KW + kw) * C + c0);
      long iw = ow * sw - pw + kw * dw;
#define KDW_PIX(P, A) \
      if ((allpx || P < px) && (inside || (unsigned long)(iw + P * sw) < (unsigned long)W)) \
        A = _mm512_fmadd_ps(KDW_LOAD(xr + (iw + P * sw) * xw), wv, A);
      KDW_PIX(0, a0) KDW_PIX(1, a1) KDW_PIX(2, a2) KDW_PIX(3, a3)
      KDW_PIX(4, a4) KDW_PIX(5, a5) KDW_PIX(6, a6) KDW_PIX(7, a7)
#undef KDW_PIX
    }
  }
  float *o = orow + ow * C + c0;
  const float *r = rrow ? rrow + ow * C + c0 : 0;
#define KDW_OUT(P, A) \
  if (allpx || P < px) { \
    __m512 y = r ? _mm512_add_ps(A, KDW_LOAD(r + P * C)) : A; \
    y = kcv_act16(y, act); \
    if (full) _mm512_storeu_ps(o + P * C, y); else _mm512_mask_storeu_ps(o + P * C, m, y); \
  }
  KDW_OUT(0, a0) KDW_OUT(1, a1) KDW_OUT(2, a2) KDW_OUT(3, a3)
  KDW_OUT(4, a4) KDW_OUT(5, a5) KDW_OUT(6, a6) KDW_OUT(7, a7)
#undef KDW_OUT
#undef KDW_LOAD
}
#elif defined(KMG_AVX2)
/* AVX2: 4 pixels x 16 channels, eight 8-wide accumulators */
#define KDW_PX 4
#define KDW_CW 16
static inline __m256i kdw_mask(long n) {
  const int idx[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  __m256i i = _mm256_loadu_si256((const __m256i *)idx);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), i);
}
static inline __attribute__((always_inline)) void kdw_block(
    const float *xi, long xh, long xw, const float *wt, long C, long c0, long cw, const float *bias,
    const float *rrow, int act, long H, long W, long KH, long KW, long sw, long pw, long dh, long dw,
    long ih0, long ow, long px, float *orow, const int full, const int inside, const int allpx) {
  __m256i m0 = kdw_mask(cw), m1 = kdw_mask(cw - 8);
#define KDW_LOAD(p, m) (full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m))
  __m256 b0 = bias ? KDW_LOAD(bias + c0, m0) : _mm256_setzero_ps();
  __m256 b1 = bias ? KDW_LOAD(bias + c0 + 8, m1) : _mm256_setzero_ps();
  __m256 a00 = b0, a01 = b1, a10 = b0, a11 = b1, a20 = b0, a21 = b1, a30 = b0, a31 = b1;
  for (long kh = 0; kh < KH; kh++) {
    long ih = ih0 + kh * dh;
    if (ih < 0 || ih >= H) continue;
    const float *xr = xi + ih * xh + c0;
    for (long kw = 0; kw < KW; kw++) {
      const float *wp = wt + (kh * KW + kw) * C + c0;
      __m256 w0 = KDW_LOAD(wp, m0), w1 = KDW_LOAD(wp + 8, m1);
      long iw = ow * sw - pw + kw * dw;
#define KDW_PIX(P, A0, A1) \
      if ((allpx || P < px) && (inside || (unsigned long)(iw + P * sw) < (unsigned long)W)) { \
        const float *xp = xr + (iw + P * sw) * xw; \
        A0 = _mm256_fmadd_ps(KDW_LOAD(xp, m0), w0, A0); \
        A1 = _mm256_fmadd_ps(KDW_LOAD(xp + 8, m1), w1, A1); \
      }
      KDW_PIX(0, a00, a01) KDW_PIX(1, a10, a11) KDW_PIX(2, a20, a21) KDW_PIX(3, a30, a31)
#undef KDW_PIX
    }
  }
  float *o = orow + ow * C + c0;
  const float *r = rrow ? rrow + ow * C + c0 : 0;
#define KDW_OUT(P, A0, A1) \
  if (allpx || P < px) { \
    __m256 y0 = A0, y1 = A1; \
    if (r) { y0 = _mm256_add_ps(y0, KDW_LOAD(r + P * C, m0)); y1 = _mm256_add_ps(y1, KDW_LOAD(r + P * C + 8, m1)); } \
    y0 = kcv_act8(y0, act); y1 = kcv_act8(y1, act); \
    if (full) { _mm256_storeu_ps(o + P * C, y0); _mm256_storeu_ps(o + P * C + 8, y1); } \
    else { _mm256_maskstore_ps(o + P * C, m0, y0); _mm256_maskstore_ps(o + P * C + 8, m1, y1); } \
  }
  KDW_OUT(0, a00, a01) KDW_OUT(1, a10, a11) KDW_OUT(2, a20, a21) KDW_OUT(3, a30, a31)
#undef KDW_OUT
#undef KDW_LOAD
}
#else
#define KDW_PX 4
#define KDW_CW 16
static inline void kdw_block(const float *xi, long xh, long xw, const float *wt, long C, long c0, long cw,
                             const float *bias, const float *rrow, int act, long H, long W, long KH, long KW,
                             long sw, long pw, long dh, long dw, long ih0, long ow, long px, float *orow,
                             const int full, const int inside, const int allpx) {
  (void)full; (void)inside; (void)allpx;
  float acc[KDW_PX][KDW_CW];
  for (long p = 0; p < px; p++)
    for (long c = 0; c < cw; c++) acc[p][c] = bias ? bias[c0 + c] : 0.0f;
  for (long kh = 0; kh < KH; kh++) {
    long ih = ih0 + kh * dh;
    if (ih < 0 || ih >= H) continue;
    for (long kw = 0; kw < KW; kw++) {
      const float *wp = wt + (kh * KW + kw) * C + c0;
      for (long p = 0; p < px; p++) {
        long iw = (ow + p) * sw - pw + kw * dw;
        if (iw < 0 || iw >= W) continue;
        const float *xp = xi + ih * xh + iw * xw + c0;
        for (long c = 0; c < cw; c++) acc[p][c] += xp[c] * wp[c];
      }
    }
  }
  for (long p = 0; p < px; p++)
    for (long c = 0; c < cw; c++) {
      long i = (ow + p) * C + c0 + c;
      orow[i] = kcv_act1(acc[p][c] + (rrow ? rrow[i] : 0.0f), act);
    }
}
#endif

/* the output pixels [lo, hi) of one row in blocks of KDW_PX, all channels; `inside`: every
   tap of these pixels is inside the row */
static inline __attribute__((always_inline)) void kdw_span(
    const float *xi, long xh, long xw, const float *wt, long C, const float *bias, const float *rrow, int act,
    long H, long W, long KH, long KW, long sw, long pw, long dh, long dw, long ih0, long lo, long hi,
    float *orow, const int inside) {
  for (long ow = lo; ow < hi; ow += KDW_PX) {
    long px = hi - ow < KDW_PX ? hi - ow : KDW_PX, c0 = 0;
    if (inside && px == KDW_PX) {
      for (; c0 + KDW_CW <= C; c0 += KDW_CW)
        kdw_block(xi, xh, xw, wt, C, c0, KDW_CW, bias, rrow, act, H, W, KH, KW, sw, pw, dh, dw, ih0, ow, px, orow,
                  1, 1, 1);
      if (c0 < C)
        kdw_block(xi, xh, xw, wt, C, c0, C - c0, bias, rrow, act, H, W, KH, KW, sw, pw, dh, dw, ih0, ow, px, orow,
                  0, 1, 1);
    } else {
      for (; c0 < C; c0 += KDW_CW)
        kdw_block(xi, xh, xw, wt, C, c0, C - c0 < KDW_CW ? C - c0 : KDW_CW, bias, rrow, act, H, W, KH, KW, sw, pw,
                  dh, dw, ih0, ow, px, orow, 0, inside, 0);
    }
  }
}

/* out[n,oh,ow,c] (NHWC) = act(bias[c] + sum_(kh,kw) x[n, ih, iw, c] wt[kh][kw][c] + res[n,oh,ow,c]);
   x's element (n,c,h,w) at x[n*xn + c + h*xh + w*xw] (channels unit-stride).  Each row is
   split into the pixels whose taps are all inside it (no bounds checks) and the borders. */
void kiln_conv_dw_f32(long N, long C, long H, long W, long OH, long OW, long KH, long KW,
                      long sh, long sw, long ph, long pw, long dh, long dw,
                      const float *x, long xn, long xh, long xw,
                      const float *wt, const float *bias, const float *res, int act, float *out, int nthreads) {
  /* interior: ow*sw - pw >= 0 and ow*sw - pw + (KW-1)*dw <= W-1 */
  long lo = (pw + sw - 1) / sw, top = W - 1 + pw - (KW - 1) * dw;
  long hi = top < 0 ? 0 : top / sw + 1;
  if (hi > OW) hi = OW;
  if (lo >= hi) lo = hi = OW;
  #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
  for (long n = 0; n < N; n++) {
    for (long oh = 0; oh < OH; oh++) {
      float *orow = out + (n * OH + oh) * OW * C;
      const float *rrow = res ? res + (n * OH + oh) * OW * C : 0, *xi = x + n * xn;
      long ih0 = oh * sh - ph;
      kdw_span(xi, xh, xw, wt, C, bias, rrow, act, H, W, KH, KW, sw, pw, dh, dw, ih0, 0, lo, orow, 0);
      kdw_span(xi, xh, xw, wt, C, bias, rrow, act, H, W, KH, KW, sw, pw, dh, dw, ih0, lo, hi, orow, 1);
      kdw_span(xi, xh, xw, wt, C, bias, rrow, act, H, W, KH, KW, sw, pw, dh, dw, ih0, hi, OW, orow, 0);
    }
  }
}
"""

__all__ = ["DW_SOURCE"]
