"""The C source of kiln's fused CPU attention (:mod:`.attention` documents the algorithm):
a portable kernel on 8-wide AVX2 tiles (scalar without AVX2) and, on CPUs with AVX-512, a
kernel that keeps each panel's scores in registers (``ka_attention_512``, in
:mod:`.attention_avx512`), behind one entry per element type, ``kiln_attention_f32`` and
``kiln_attention_bf16`` (AVX-512 only)."""

from __future__ import annotations

from .attention_avx512 import AVX512 as _AVX512
from .fast_math import EXP_HELPER

QUERY_TILE = 48
"""Query rows per task (they share each transposed key block)."""
KEY_BLOCK = 64
"""Keys per block of the online softmax."""

_PORTABLE_HEAD = r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KA_AVX2 1
#endif
#define KA_QT %(qt)d
#define KA_BK %(bk)d

%(exp_helper)s

/* s[j] = exp(s[j] - m) for the KA_BK scores of a row; -inf (masked) gives exactly 0 */
#ifdef KA_AVX2
static inline __m256 ka_exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  __m256 fn = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fn), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline void ka_exp_row(float *s, float m) {
  __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
  for (int j = 0; j < KA_BK; j += 8) {
    __m256 x = _mm256_loadu_ps(s + j);
    __m256 e = ka_exp8(_mm256_sub_ps(x, vm));
    _mm256_storeu_ps(s + j, _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), e));
  }
}
#else
static inline void ka_exp_row(float *s, float m) {
  for (int j = 0; j < KA_BK; j++) s[j] = s[j] == -INFINITY ? 0.0f : kiln_expf(s[j] - m);
}
#endif

/* c[6][16] (row stride ldc) (+)= a[kc][6] @ b[kc][16] (row stride ldb) */
#ifdef KA_AVX2
static inline void ka_tile(long kc, const float *a, const float *b, long ldb, float *c, long ldc, int acc) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (acc) {
    c00 = _mm256_loadu_ps(c); c01 = _mm256_loadu_ps(c + 8);
    c10 = _mm256_loadu_ps(c + ldc); c11 = _mm256_loadu_ps(c + ldc + 8);
    c20 = _mm256_loadu_ps(c + 2 * ldc); c21 = _mm256_loadu_ps(c + 2 * ldc + 8);
    c30 = _mm256_loadu_ps(c + 3 * ldc); c31 = _mm256_loadu_ps(c + 3 * ldc + 8);
    c40 = _mm256_loadu_ps(c + 4 * ldc); c41 = _mm256_loadu_ps(c + 4 * ldc + 8);
    c50 = _mm256_loadu_ps(c + 5 * ldc); c51 = _mm256_loadu_ps(c + 5 * ldc + 8);
  } else {
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
  }
  for (long k = 0; k < kc; k++) {
    __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), x;
    x = _mm256_broadcast_ss(a + 0); c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01);
    x = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11);
    x = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21);
    x = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31);
    x = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41);
    x = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51);
    a += 6; b += ldb;
  }
  _mm256_storeu_ps(c, c00); _mm256_storeu_ps(c + 8, c01);
  _mm256_storeu_ps(c + ldc, c10); _mm256_storeu_ps(c + ldc + 8, c11);
  _mm256_storeu_ps(c + 2 * ldc, c20); _mm256_storeu_ps(c + 2 * ldc + 8, c21);
  _mm256_storeu_ps(c + 3 * ldc, c30); _mm256_storeu_ps(c + 3 * ldc + 8, c31);
  _mm256_storeu_ps(c + 4 * ldc, c40); _mm256_storeu_ps(c + 4 * ldc + 8, c41);
  _mm256_storeu_ps(c + 5 * ldc, c50); _mm256_storeu_ps(c + 5 * ldc + 8, c51);
}
#else
static inline void ka_tile(long kc, const float *a, const float *b, long ldb, float *c, long ldc, int acc) {
  float t[6][16];
  for (int r = 0; r < 6; r++) for (int j = 0; j < 16; j++) t[r][j] = acc ? c[r * ldc + j] : 0.0f;
  for (long k = 0; k < kc; k++)
    for (int r = 0; r < 6; r++) for (int j = 0; j < 16; j++) t[r][j] += a[k * 6 + r] * b[k * ldb + j];
  for (int r = 0; r < 6; r++) for (int j = 0; j < 16; j++) c[r * ldc + j] = t[r][j];
}
#endif

"""


_ENTRY = r"""/* out[b,h,i,:] = softmax_j(q[b,h,i,:] . k[b,h/group,j,:] * scale + mask[b,h,i,j]) v[b,h/group,j,:]
   Last axes of q, k, v unit-stride; other strides in elements (0 for broadcast axes).
   mkind: 0 none, 1 bool (keep where nonzero), 2 float32 (added).  Returns 1 without memory. */
int kiln_attention_f32(long B, long H, long L, long S, long E, long Ev, long group,
                       const float *q, long qb, long qh, long ql,
                       const float *k, long kb, long kh, long ks,
                       const float *v, long vb, long vh, long vs,
                       const void *mask, int mkind, long mb, long mh, long ml, long ms,
                       int causal, float scale, float *o, long ob, long oh, long ol, int nthreads) {
#ifdef KA_AVX512
  return ka_attention_512(B, H, L, S, E, Ev, group, q, qb, qh, ql, k, kb, kh, ks, v, vb, vh, vs, mask, mkind,
                          mb, mh, ml, ms, causal, scale, o, ob, oh, ol, nthreads, 0);
#endif
  long tiles = (L + KA_QT - 1) / KA_QT;
  /* a task is one (batch, head) and a chunk of its query tiles; the keys it reads are
     packed once per task.  Heads are split into chunks only when there are fewer than
     two per thread. */
  long heads = B * H;
  long chunks = heads >= 2 * nthreads ? 1 : (2 * nthreads + heads - 1) / heads;
  if (chunks > tiles) chunks = tiles;
  long per_chunk = chunks > 0 ? (tiles + chunks - 1) / chunks : 0;
  long tasks = heads * chunks;
  long evw = (Ev + 15) / 16 * 16;  /* accumulator row width */
  long ev16 = Ev / 16 * 16;        /* columns the micro-kernel covers */
  long spanels = (S + 15) / 16;
  int failed = 0;
  if (tasks <= 0) return 0;
  #pragma omp parallel num_threads(nthreads) reduction(|:failed)
  {
    long e1 = E > 0 ? E : 1;
    float *qp = (float *)aligned_alloc(64, sizeof(float) * (size_t)(KA_QT * e1));                /* [QT/6][E][6] */
    float *kp = (float *)aligned_alloc(64, sizeof(float) * (size_t)((spanels + 1) * 16 * e1));  /* [S/16][E][16] */
    float *acc = (float *)aligned_alloc(64, sizeof(float) * (size_t)(KA_QT * evw + 16));         /* [QT][evw] */
    float s[6 * KA_BK] __attribute__((aligned(64)));
    float pp[KA_BK * 6] __attribute__((aligned(64)));   /* P of 6 rows, [BK][6] */
    float mrow[KA_QT], lrow[KA_QT];
    if (!qp || !kp || !acc) failed = 1;
    #pragma omp for schedule(dynamic, 1)
    for (long task = 0; task < tasks; task++) {
      if (!qp || !kp || !acc) continue;
      long b = task / (H * chunks), h = (task / chunks) %% H, chunk = task %% chunks;
      long t0 = chunk * per_chunk, t1 = t0 + per_chunk < tiles ? t0 + per_chunk : tiles;
      if (t0 >= t1) continue;
      const float *kt = k + b * kb + (h / group) * kh;
      const float *vt = v + b * vb + (h / group) * vh;
      long last = t1 * KA_QT < L ? t1 * KA_QT : L;
      long kend = causal ? (last < S ? last : S) : S;
      long kpad = (kend + 15) / 16 * 16;
      for (long j = 0; j < kpad; j++) {
        float *dst = kp + (j / 16) * E * 16 + j %% 16;
        if (j < kend) {
          const float *src = kt + j * ks;
          for (long e = 0; e < E; e++) dst[e * 16] = src[e];
        } else {
          for (long e = 0; e < E; e++) dst[e * 16] = 0.0f;
        }
      }
      for (long tile = t0; tile < t1; tile++) {
      long i0 = tile * KA_QT;
      long rows = L - i0 < KA_QT ? L - i0 : KA_QT;
      long panels = (rows + 5) / 6;
      const float *qt = q + b * qb + h * qh + i0 * ql;
      float *ot = o + b * ob + h * oh + i0 * ol;
      for (long mp = 0; mp < panels; mp++)
        for (int r = 0; r < 6; r++) {
          long row = mp * 6 + r;
          float *dst = qp + mp * E * 6 + r;
          if (row < rows) {
            const float *src = qt + row * ql;
            for (long e = 0; e < E; e++) dst[e * 6] = src[e] * scale;
          } else {
            for (long e = 0; e < E; e++) dst[e * 6] = 0.0f;
          }
        }
      for (long r = 0; r < KA_QT; r++) { mrow[r] = -INFINITY; lrow[r] = 0.0f; }
      memset(acc, 0, sizeof(float) * (size_t)(panels * 6 * evw));
      long send = causal ? (i0 + rows < S ? i0 + rows : S) : S;
      for (long j0 = 0; j0 < send; j0 += KA_BK) {
        long w = send - j0 < KA_BK ? send - j0 : KA_BK;
        long kpanels = (w + 15) / 16;
        for (long mp = 0; mp < panels; mp++) {
          long r0 = mp * 6;
          if (causal && j0 > i0 + r0 + 5) continue;  /* no row of this panel sees the block */
          for (long p = 0; p < kpanels; p++) ka_tile(E, qp + mp * E * 6, kp + (j0 / 16 + p) * E * 16, 16, s + p * 16, KA_BK, 0);
          int any = 0;
          for (int r = 0; r < 6; r++) {
            long row = r0 + r, i = i0 + row;
            float *sr = s + r * KA_BK;
            long lim = w;
            if (row >= rows) lim = 0;
            if (causal && i - j0 + 1 < lim) lim = i - j0 + 1 > 0 ? i - j0 + 1 : 0;
            if (lim > 0 && mkind == 1) {
              const unsigned char *mr = (const unsigned char *)mask + b * mb + h * mh + i * ml + j0 * ms;
              for (long j = 0; j < lim; j++) if (!mr[j * ms]) sr[j] = -INFINITY;
            } else if (lim > 0 && mkind == 2) {
              const float *mr = (const float *)mask + b * mb + h * mh + i * ml + j0 * ms;
              for (long j = 0; j < lim; j++) sr[j] += mr[j * ms];
            }
            float mx = -INFINITY;
            #pragma omp simd reduction(max:mx)
            for (long j = 0; j < lim; j++) mx = sr[j] > mx ? sr[j] : mx;
            if (mx == -INFINITY) {  /* nothing seen in this block */
              for (long j = 0; j < KA_BK; j++) pp[j * 6 + r] = 0.0f;
              continue;
            }
            any = 1;
            float mold = mrow[row], mnew = mold > mx ? mold : mx;
            for (long j = lim; j < KA_BK; j++) sr[j] = -INFINITY;
            ka_exp_row(sr, mnew);
            float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (long j = 0; j < KA_BK; j += 8)
              for (int u = 0; u < 8; u++) lanes[u] += sr[j + u];
            float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
            for (long j = 0; j < KA_BK; j++) pp[j * 6 + r] = sr[j];
            if (mold != mnew) {
              float corr = mold == -INFINITY ? 0.0f : kiln_expf(mold - mnew);
              float *ar = acc + row * evw;
              lrow[row] *= corr;
              #pragma omp simd
              for (long e = 0; e < Ev; e++) ar[e] *= corr;
            }
            lrow[row] += sum;
            mrow[row] = mnew;
          }
          if (!any) continue;
          float *ap = acc + r0 * evw;
          for (long c0 = 0; c0 < ev16; c0 += 16) ka_tile(w, pp, vt + j0 * vs + c0, vs, ap + c0, evw, 1);
          for (long c = ev16; c < Ev; c++)
            for (int r = 0; r < 6; r++) {
              float sum = ap[r * evw + c];
              for (long j = 0; j < w; j++) sum += pp[j * 6 + r] * vt[(j0 + j) * vs + c];
              ap[r * evw + c] = sum;
            }
        }
      }
      for (long r = 0; r < rows; r++) {
        float inv = lrow[r] > 0.0f ? 1.0f / lrow[r] : 0.0f;
        const float *ar = acc + r * evw;
        float *orow = ot + r * ol;
        #pragma omp simd
        for (long e = 0; e < Ev; e++) orow[e] = ar[e] * inv;
      }
      }
    }
    free(qp);
    free(kp);
    free(acc);
  }
  return failed;
}
"""

_SIZES = {"qt": QUERY_TILE, "bk": KEY_BLOCK, "exp_helper": EXP_HELPER}
SOURCE = _PORTABLE_HEAD % _SIZES + _AVX512 + _ENTRY % _SIZES
"""The whole translation unit (sizes substituted)."""

__all__ = ["KEY_BLOCK", "QUERY_TILE", "SOURCE"]
