"""kiln's bfloat16 GEMM: the tiles of :mod:`.microgemm` on bf16 operands, with AVX-512 BF16 or AVX2.

**bfloat16** (``kiln_mgemm_bf16``): bf16 operands and result, float32 accumulation.  B is
packed in *pair panels*, ``(ceil(N/16), ceil(K/2), 32)``: 16 columns, the two ``k`` of a pair
adjacent (:func:`packed_shape_bf16`, :func:`pack_pairs`, the layout of
:func:`kiln.backends.cpu.packing.write_pairs`).  Partial sums of K blocks before the last stay
in a float32 copy of C and the last block rounds to bf16 (nearest even) as it stores.  Two
instruction sets:

* **AVX-512 BF16**: ``vdpbf16ps`` multiplies 16 pairs of bf16 values and adds each pair's sum
  to a float32 lane, so one instruction does the work of two f32 FMAs.  A's micro-panels hold
  the pairs of a row together, so a row's pair is one 32-bit broadcast; the tiles are the f32
  ones (12x32, 24 accumulators).  On the 2-vCPU AMD EPYC with AVX-512 BF16, 2 threads: GPT-2's
  ``128 x 768 @ 768 x 3072`` at ~390 GFLOP/s (f32: ~200, torch's bf16 matmul: ~370).  Up to
  four rows of A (a decoder's tokens) take a path of their own (``kmbv_gemm``): the threads
  split the pair panels and stream them once over the whole K with A's pairs broadcast from A,
  no packing, K blocks or float copy of C -- ``1 x 768 @ 768 x 3072`` in 31 us (the tiles: 61,
  kiln's f32 GEMV: 55, torch's bf16: 140), so GPT-2 small at sequence length 1 under
  ``amp="bf16"`` takes 3.9 ms against 7.6 for float32.
* **AVX2 + FMA** (no bf16 arithmetic): bf16 storage, float32 arithmetic.  A 32-bit lane of a
  pair panel holds one column's (even k, odd k), so a shift left by 16 gives the even k's
  float and a shift right then left the odd k's: one load and three shifts widen 16 values of
  B, read at half float32's bytes.  A is widened to float as it is packed, and the tile is the
  f32 one (6x16, 12 accumulators).  On the 2-vCPU AMD EPYC with AVX2 (no AVX-512), where
  torch's bf16 matmul is emulated (``128 x 768 @ 768 x 3072`` in 474 ms, f32: 5.2), it runs
  GPT-2's GEMMs at kiln's f32 speed (170-190 GFLOP/s at 2 threads, 91-95 at one) and one row
  (``1 x 1024 @ 1024 x 4096``) in 116 against 152 us for f32; GPT-2 small under
  ``amp="bf16"`` takes 154 ms at sequence 128 (f32: 163, torch's GEMMs: 15.6 s) and 5.6 ms at
  sequence 1 (f32: 9.2).  Only one row takes the streaming path here: from two rows on, its
  widening and broadcasts of A outnumber the multiply-adds and the tiles are faster.

A tall, narrow product (``M >= 192``, ``N <= 1024``) is split by rows between the threads, as in
:mod:`.microgemm`: ViT's ``196 x 768 @ 768 x 192`` took 440 us with the shared blocks and their
barriers, 345 split (AVX2, 2 threads).

Without either ``kiln_mgemm_bf16_available()`` is 0 and bf16 GEMMs stay library calls.

It is a shared object of its own (:data:`SOURCE`: :mod:`.microgemm`'s prelude and this
kernel), built on first use by the compiler that built kiln's float32 GEMM
(``MicroGemm.bf16``), so a float32 model never compiles it.  Generated kernels call it
through a function pointer set after loading (``kiln_set_mgemm_bf16``).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kiln.runtime.cache import CompileCache

from .microgemm import PRELUDE, load_gemm, panel_count
from .packing import PAIR_WIDTH, write_pairs

SOURCE = PRELUDE + r"""
/* C[M,N] (bf16) = A (bf16) @ B (bf16) with float32 accumulation.  B is packed in pair panels
   Bp[p][k/2][16][2] (16 columns, the two k of a pair adjacent; zero-padded), A per micro-panel
   as [k/2][KMG_MR][2].  Two instruction sets:
   - AVX-512 BF16 (KMB_DPBF16): vdpbf16ps multiplies 16 pairs of bf16 values and adds each
     pair's sum to a float32 lane, twice the multiply-adds of an f32 FMA; A's pairs stay bf16,
     so a row's pair is one 32-bit broadcast, and a unit is two panels (a 12x32 tile).
   - AVX2 + FMA (KMB_WIDEN): bf16 storage, float32 arithmetic.  A 32-bit lane of a pair panel
     holds (k even, k odd) of one column, so shifting it left by 16 gives the even k's float
     and masking off its low half the odd k's: one load and two integer operations widen 16
     values of B, read at half float32's bytes.  A is widened as it is packed (A's panels are
     float pairs), and a unit is one panel (a 6x16 tile in 12 of the 16 registers).
   Partial sums of K blocks before the last live in a float32 copy of C; the last block rounds
   to bf16 (nearest even) as it stores. */
#if defined(KMG_AVX512) && defined(__AVX512BF16__)
#define KMB_DPBF16 1
#elif defined(KMG_AVX2)
#define KMB_WIDEN 1
#endif
#if defined(KMB_DPBF16) || defined(KMB_WIDEN)
typedef unsigned short kmb_t;
#define KMB_ROWS1(X) X(0)
#define KMB_ROWS2(X) KMB_ROWS1(X) X(1)
#define KMB_ROWS3(X) KMB_ROWS2(X) X(2)
#define KMB_ROWS4(X) KMB_ROWS3(X) X(3)
#define KMB_ROWS5(X) KMB_ROWS4(X) X(4)
#define KMB_ROWS6(X) KMB_ROWS5(X) X(5)
#define KMB_ROWS7(X) KMB_ROWS6(X) X(6)
#define KMB_ROWS8(X) KMB_ROWS7(X) X(7)
#define KMB_ROWS9(X) KMB_ROWS8(X) X(8)
#define KMB_ROWS10(X) KMB_ROWS9(X) X(9)
#define KMB_ROWS11(X) KMB_ROWS10(X) X(10)
#define KMB_ROWS12(X) KMB_ROWS11(X) X(11)

int kiln_mgemm_bf16_available(void) { return 1; }

void kiln_mgemm_pack_b_bf16(long K, long N, const kmb_t *B, long sk, long sn, kmb_t *Bp) {
  long panels = (N + KMG_NR - 1) / KMG_NR, K2 = (K + 1) / 2;
  #pragma omp parallel for schedule(static)
  for (long p = 0; p < panels; p++) {
    kmb_t *dst = Bp + p * K2 * 2 * KMG_NR;
    long n0 = p * KMG_NR, w = N - n0 < KMG_NR ? N - n0 : KMG_NR;
    for (long k2 = 0; k2 < K2; k2++)
      for (long j = 0; j < KMG_NR; j++)
        for (long t = 0; t < 2; t++) {
          long k = 2 * k2 + t;
          dst[(k2 * KMG_NR + j) * 2 + t] = k < K && j < w ? B[k * sk + (n0 + j) * sn] : 0;
        }
  }
}

/* round to nearest even, as vcvtneps2bf16 does */
static inline kmb_t kmb_round(float v) {
  unsigned int u; memcpy(&u, &v, 4);
  return (kmb_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------ few rows */
/* Up to KMBV_MAX_M rows of A (a decoder's tokens: 4 with AVX-512 BF16, 1 with AVX2) are bound
   by reading B: each thread takes a range of pair panels and streams them once over the whole
   K, in groups of up to 4 panels (64 columns) x M rows of accumulators (kmbv_group), A's pairs broadcast from
   A itself (no packing of A, no K blocks, no float copy of C, no barriers). */
#ifdef KMB_DPBF16
typedef kmb_t kmb_a_t;  /* A's packed element: bf16 pairs */
#define KMB_A(x) (x)
#define KMB_UNIT_PANELS 2
#define KMBV_MAX_M 4
/* the pair (k, k + 1) of a row of A (k + 1 past the end reads as zero); with CONTIG (unit
   stride along k) and a whole pair, one 32-bit load */
static inline __attribute__((always_inline)) int kmbv_pair(const kmb_t *a, long ak, long k, long K,
                                                           const int CONTIG) {
  if (CONTIG && k + 1 < K) { int v; memcpy(&v, a + k, sizeof v); return v; }
  unsigned int lo = a[k * ak], hi = k + 1 < K ? a[(k + 1) * ak] : 0;
  return (int)(lo | (hi << 16));
}
static inline __m512 kmb_load(const float *cf) { return _mm512_loadu_ps(cf); }
static inline void kmb_store(float *cf, kmb_t *cb, __m512 v, int last) {
  if (last) _mm256_storeu_si256((__m256i *)cb, (__m256i)_mm512_cvtneps_pbh(v));
  else _mm512_storeu_ps(cf, v);
}
#define KMB_PAIR(r) (((const int *)ap)[r])
#define KMB_DECL(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps();
#define KMB_LOAD1(r) c##r##0 = kmb_load(cf + r * ldf);
#define KMB_LOAD2(r) c##r##0 = kmb_load(cf + r * ldf); c##r##1 = kmb_load(cf + r * ldf + 16);
#define KMB_DP1(r) c##r##0 = _mm512_dpbf16_ps(c##r##0, (__m512bh)_mm512_set1_epi32(KMB_PAIR(r)), b0);
#define KMB_DP2(r) { __m512bh a = (__m512bh)_mm512_set1_epi32(KMB_PAIR(r)); \
  c##r##0 = _mm512_dpbf16_ps(c##r##0, a, b0); c##r##1 = _mm512_dpbf16_ps(c##r##1, a, b1); }
#define KMB_STORE1(r) kmb_store(cf + r * ldf, cb + r * ldb, c##r##0, last);
#define KMB_STORE2(r) kmb_store(cf + r * ldf, cb + r * ldb, c##r##0, last); \
  kmb_store(cf + r * ldf + 16, cb + r * ldb + 16, c##r##1, last);
/* c[R][16] (or [R][32] from two panels) of k-pair block kc2: ap as pairs (KMG_MR per k2),
   bp/bq as pair panels; partial sums from cf when acc, results to cf, or cb on the last block */
#define KMB_TILE(R) \
static inline void kmb_tile##R(long kc2, const kmb_a_t *ap, const kmb_t *bp, float *cf, long ldf, kmb_t *cb, \
                               long ldb, int acc, int last) { \
  KMB_ROWS##R(KMB_DECL) \
  if (acc) { KMB_ROWS##R(KMB_LOAD1) } \
  _Pragma("GCC unroll 4") for (long k = 0; k < kc2; k++) { \
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp); \
    KMB_ROWS##R(KMB_DP1) \
    ap += 2 * KMG_MR; bp += 2 * KMG_NR; \
  } \
  KMB_ROWS##R(KMB_STORE1) \
} \
static inline void kmb_pair##R(long kc2, const kmb_a_t *ap, const kmb_t *bp, const kmb_t *bq, float *cf, \
                               long ldf, kmb_t *cb, long ldb, int acc, int last) { \
  KMB_ROWS##R(KMB_DECL) \
  if (acc) { KMB_ROWS##R(KMB_LOAD2) } \
  _Pragma("GCC unroll 4") for (long k = 0; k < kc2; k++) { \
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bq); \
    KMB_ROWS##R(KMB_DP2) \
    ap += 2 * KMG_MR; bp += 2 * KMG_NR; bq += 2 * KMG_NR; \
  } \
  KMB_ROWS##R(KMB_STORE2) \
}
KMB_TILE(1) KMB_TILE(2) KMB_TILE(3) KMB_TILE(4) KMB_TILE(5) KMB_TILE(6)
KMB_TILE(7) KMB_TILE(8) KMB_TILE(9) KMB_TILE(10) KMB_TILE(11) KMB_TILE(12)

/* the accumulators of up to four panels (64 columns) x M rows over the whole K, stored to C */
static inline __attribute__((always_inline)) void kmbv_group(
    long M, long K, const kmb_t *A, long am, long ak, const kmb_t *bp, long pstride, long np, kmb_t *C, long ldc,
    long n0, long N, const int CONTIG) {
  __m512 acc[KMBV_MAX_M][4];
  for (int m = 0; m < KMBV_MAX_M; m++)
    for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
  long K2 = (K + 1) / 2;
  for (long k2 = 0; k2 < K2; k2++) {
    __m512bh b[4];
    for (int j = 0; j < 4; j++)
      if (j < np) b[j] = (__m512bh)_mm512_loadu_si512(bp + j * pstride + k2 * 2 * KMG_NR);
    for (int m = 0; m < KMBV_MAX_M && m < M; m++) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(kmbv_pair(A + m * am, ak, 2 * k2, K, CONTIG));
      for (int j = 0; j < 4; j++)
        if (j < np) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
    }
  }
  for (int m = 0; m < KMBV_MAX_M && m < M; m++)
    for (int j = 0; j < np; j++) {
      long c0 = n0 + j * KMG_NR, w = N - c0 < KMG_NR ? N - c0 : KMG_NR;
      __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[m][j]);
      if (w == KMG_NR) _mm256_storeu_si256((__m256i *)(C + m * ldc + c0), v);
      else _mm256_mask_storeu_epi16(C + m * ldc + c0, (__mmask16)((1u << w) - 1u), v);
    }
}
#else  /* KMB_WIDEN */
typedef float kmb_a_t;  /* A's packed element: widened to float as it is packed */
static inline float kmb_widen(kmb_t x) { unsigned int u = (unsigned int)x << 16; float f; memcpy(&f, &u, 4); return f; }
#define KMB_A(x) kmb_widen(x)
#define KMB_UNIT_PANELS 1
/* one row only: from two rows on, the tiles beat streaming B (4 x 768 @ 768 x 3072: 152 against
   268 us at 2 threads), whose A widening and broadcasts then outnumber the multiply-adds */
#define KMBV_MAX_M 1
#define KMB_EVEN(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define KMB_ODD(v) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(v, 16), 16))
/* 8 floats rounded to nearest even bf16 */
static inline __m128i kmb_round8(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}
static inline void kmb_store8(float *cf, kmb_t *cb, __m256 v, int last) {
  if (last) _mm_storeu_si128((__m128i *)cb, kmb_round8(v));
  else _mm256_storeu_ps(cf, v);
}
#define KMB_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define KMB_LOAD1(r) c##r##0 = _mm256_loadu_ps(cf + r * ldf); c##r##1 = _mm256_loadu_ps(cf + r * ldf + 8);
#define KMB_FMA(r, t) { __m256 a = _mm256_broadcast_ss(ap + 2 * r + t); \
  c##r##0 = _mm256_fmadd_ps(a, lo, c##r##0); c##r##1 = _mm256_fmadd_ps(a, hi, c##r##1); }
#define KMB_FMA_EVEN(r) KMB_FMA(r, 0)
#define KMB_FMA_ODD(r) KMB_FMA(r, 1)
#define KMB_STORE1(r) kmb_store8(cf + r * ldf, cb + r * ldb, c##r##0, last); \
  kmb_store8(cf + r * ldf + 8, cb + r * ldb + 8, c##r##1, last);
/* c[R][16] of k-pair block kc2: ap as float pairs (KMG_MR per k2), bp as a pair panel; the
   even k's products, then the odd k's (12 accumulators and two of B live at a time) */
#define KMB_TILE(R) \
static inline void kmb_tile##R(long kc2, const kmb_a_t *ap, const kmb_t *bp, float *cf, long ldf, kmb_t *cb, \
                               long ldb, int acc, int last) { \
  KMB_ROWS##R(KMB_DECL) \
  if (acc) { KMB_ROWS##R(KMB_LOAD1) } \
  for (long k = 0; k < kc2; k++) {  /* not unrolled: unrolled, GCC spilled (56 against 94 GFLOP/s) */ \
    __m256i v0 = _mm256_loadu_si256((const __m256i *)bp), v1 = _mm256_loadu_si256((const __m256i *)(bp + 16)); \
    __m256 lo = KMB_EVEN(v0), hi = KMB_EVEN(v1); \
    KMB_ROWS##R(KMB_FMA_EVEN) \
    lo = KMB_ODD(v0); hi = KMB_ODD(v1); \
    KMB_ROWS##R(KMB_FMA_ODD) \
    ap += 2 * KMG_MR; bp += 2 * KMG_NR; \
  } \
  KMB_ROWS##R(KMB_STORE1) \
}
KMB_TILE(1) KMB_TILE(2) KMB_TILE(3) KMB_TILE(4) KMB_TILE(5) KMB_TILE(6)

/* the accumulators of up to four panels (64 columns) x M rows over the whole K, stored to C */
static inline __attribute__((always_inline)) void kmbv_group(
    long M, long K, const kmb_t *A, long am, long ak, const kmb_t *bp, long pstride, long np, kmb_t *C, long ldc,
    long n0, long N, const int CONTIG) {
  __m256 acc[KMBV_MAX_M][4][2];
  for (int m = 0; m < KMBV_MAX_M; m++)
    for (int j = 0; j < 4; j++) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_ps();
  const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);  /* a mask: fewer operations than shifts here */
  long K2 = (K + 1) / 2;
  for (long k2 = 0; k2 < K2; k2++) {
    __m256 a0[KMBV_MAX_M], a1[KMBV_MAX_M];  /* A's pair widened in general registers, then broadcast */
    for (int m = 0; m < KMBV_MAX_M && m < M; m++) {
      const kmb_t *row = A + m * am;
      a0[m] = _mm256_set1_ps(kmb_widen(row[2 * k2 * ak]));
      a1[m] = _mm256_set1_ps(2 * k2 + 1 < K ? kmb_widen(row[(2 * k2 + 1) * ak]) : 0.0f);
    }
    for (int j = 0; j < 4; j++)
      if (j < np) {
        const kmb_t *b = bp + j * pstride + k2 * 2 * KMG_NR;
        __m256i v0 = _mm256_loadu_si256((const __m256i *)b), v1 = _mm256_loadu_si256((const __m256i *)(b + 16));
        __m256 e0 = KMB_EVEN(v0), e1 = KMB_EVEN(v1);
        __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, odd)), o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, odd));
        for (int m = 0; m < KMBV_MAX_M && m < M; m++) {
          acc[m][j][0] = _mm256_fmadd_ps(a1[m], o0, _mm256_fmadd_ps(a0[m], e0, acc[m][j][0]));
          acc[m][j][1] = _mm256_fmadd_ps(a1[m], o1, _mm256_fmadd_ps(a0[m], e1, acc[m][j][1]));
        }
      }
  }
  for (int m = 0; m < KMBV_MAX_M && m < M; m++)
    for (int j = 0; j < np; j++) {
      long c0 = n0 + j * KMG_NR, w = N - c0 < KMG_NR ? N - c0 : KMG_NR;
      kmb_t t[KMG_NR];
      _mm_storeu_si128((__m128i *)t, kmb_round8(acc[m][j][0]));
      _mm_storeu_si128((__m128i *)(t + 8), kmb_round8(acc[m][j][1]));
      memcpy(C + m * ldc + c0, t, sizeof(kmb_t) * (size_t)w);
    }
}
#endif

/* a tile narrower than 16 columns (the last panel): through a float tile in scratch */
static void kmb_edge(long kc2, const kmb_a_t *ap, const kmb_t *bp, float *cf, long ldf, kmb_t *cb, long ldb,
                     int acc, int last, long rows, long w) {
  float t[KMG_MR * KMG_NR];
  KMG_BY_ROWS(kmb_tile, rows, kc2, ap, bp, t, KMG_NR, NULL, 0, 0, 0)
  for (long r = 0; r < rows; r++)
    for (long j = 0; j < w; j++) {
      float v = (acc ? cf[r * ldf + j] : 0.0f) + t[r * KMG_NR + j];
      if (last) cb[r * ldb + j] = kmb_round(v);
      else cf[r * ldf + j] = v;
    }
}

/* micro-panel ib of A's rows [ic, ic + mc), K block [pc, pc + kc), as [kc/2][KMG_MR] pairs */
static inline void kmb_pack_a(const kmb_t *A, long am, long ak, long ic, long mc, long ib, long pc, long kc,
                              kmb_a_t *dst) {
  long rows = mc - ib * KMG_MR < KMG_MR ? mc - ib * KMG_MR : KMG_MR, kc2 = (kc + 1) / 2;
  const kmb_t *src = A + (ic + ib * KMG_MR) * am + pc * ak;
  for (long k2 = 0; k2 < kc2; k2++) {
    long k = 2 * k2;
    for (long r = 0; r < rows; r++) {
      dst[(k2 * KMG_MR + r) * 2] = KMB_A(src[r * am + k * ak]);
      dst[(k2 * KMG_MR + r) * 2 + 1] = k + 1 < kc ? KMB_A(src[r * am + (k + 1) * ak]) : (kmb_a_t)0;
    }
    for (long r = rows; r < KMG_MR; r++) dst[(k2 * KMG_MR + r) * 2] = dst[(k2 * KMG_MR + r) * 2 + 1] = (kmb_a_t)0;
  }
}

/* unit u (KMB_UNIT_PANELS panels) x micro-panel ib of one (K block, row block) */
static inline __attribute__((always_inline)) void kmb_unit(long N, long K, const kmb_t *B, float *Cf, kmb_t *C,
                                                           long ldc, long ic, long mc, long ib, long u, long pc,
                                                           long kc, const kmb_a_t *ap) {
  long panels = (N + KMG_NR - 1) / KMG_NR, K2 = (K + 1) / 2, kc2 = (kc + 1) / 2;
  long m0 = ic + ib * KMG_MR, rows = mc - ib * KMG_MR < KMG_MR ? mc - ib * KMG_MR : KMG_MR;
  int acc = pc > 0, last = pc + kc >= K;
  long p = u * KMB_UNIT_PANELS;
#if KMB_UNIT_PANELS == 2
  if (p + 1 < panels && N - (p + 1) * KMG_NR >= KMG_NR) {
    const kmb_t *bp = B + p * K2 * 2 * KMG_NR + pc * KMG_NR;
    KMG_BY_ROWS(kmb_pair, rows, kc2, ap, bp, bp + K2 * 2 * KMG_NR, Cf + m0 * N + p * KMG_NR, N,
                C + m0 * ldc + p * KMG_NR, ldc, acc, last)
    return;
  }
#endif
  for (; p < panels && p < (u + 1) * KMB_UNIT_PANELS; p++) {
    const kmb_t *bp = B + p * K2 * 2 * KMG_NR + pc * KMG_NR;
    long n0 = p * KMG_NR, w = N - n0 < KMG_NR ? N - n0 : KMG_NR;
    float *cf = Cf + m0 * N + n0;
    kmb_t *cb = C + m0 * ldc + n0;
    if (w == KMG_NR) { KMG_BY_ROWS(kmb_tile, rows, kc2, ap, bp, cf, N, cb, ldc, acc, last) }
    else kmb_edge(kc2, ap, bp, cf, N, cb, ldc, acc, last, rows, w);
  }
}

static void kmbv_gemm(long M, long N, long K, const kmb_t *A, long am, long ak, const kmb_t *Bp, kmb_t *C,
                      long ldc) {
  long panels = (N + KMG_NR - 1) / KMG_NR, pstride = (K + 1) / 2 * 2 * KMG_NR;
  #pragma omp parallel
  {
#ifdef _OPENMP
    long t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    long t = 0, T = 1;
#endif
    long lo = panels * t / T, hi = panels * (t + 1) / T;
    for (long p = lo; p < hi; p += 4) {
      long np = hi - p < 4 ? hi - p : 4;
      const kmb_t *bp = Bp + p * pstride;
      if (M == 1 && np == 4 && ak == 1) kmbv_group(1, K, A, am, 1, bp, pstride, 4, C, ldc, p * KMG_NR, N, 1);
      else if (ak == 1) kmbv_group(M, K, A, am, 1, bp, pstride, np, C, ldc, p * KMG_NR, N, 1);  /* compiled */
      else kmbv_group(M, K, A, am, ak, bp, pstride, np, C, ldc, p * KMG_NR, N, 0);             /* apart */
    }
  }
}

/* rows [m_lo, m_hi) of C by one thread (a tall, narrow product, as kmg_rows): its own A
   blocks packed into its own work, every K block and panel, no barriers */
static void kmb_rows(long m_lo, long m_hi, long N, long K, const kmb_t *A, long am, long ak, const kmb_t *B,
                     float *Cf, kmb_t *C, long ldc, kmb_a_t *work) {
  long units = ((N + KMG_NR - 1) / KMG_NR + KMB_UNIT_PANELS - 1) / KMB_UNIT_PANELS;
  for (long ic = m_lo; ic < m_hi; ic += KMG_MC) {
    long mc = m_hi - ic < KMG_MC ? m_hi - ic : KMG_MC;
    long blocks = (mc + KMG_MR - 1) / KMG_MR;
    for (long pc = 0; pc < K; pc += KMG_KC) {
      long kc = K - pc < KMG_KC ? K - pc : KMG_KC, kc2 = (kc + 1) / 2;
      for (long ib = 0; ib < blocks; ib++) kmb_pack_a(A, am, ak, ic, mc, ib, pc, kc, work + ib * KMG_MR * 2 * kc2);
      for (long u = 0; u < units; u++)
        for (long ib = 0; ib < blocks; ib++)
          kmb_unit(N, K, B, Cf, C, ldc, ic, mc, ib, u, pc, kc, work + ib * KMG_MR * 2 * kc2);
    }
  }
}

/* C[M,N] (bf16, row stride ldc) = A @ B, as kiln_mgemm_f32 with bf16 operands; B in pair panels
   when packed (kiln_mgemm_pack_b_bf16), else element (k,n) at B[k*bk + n*bn].  Returns 0, or 1
   when scratch memory could not be allocated (C is then not written, or only in part). */
int kiln_mgemm_bf16(long M, long N, long K, const kmb_t *A, long am, long ak, const kmb_t *B, long bk, long bn,
                    int packed, kmb_t *C, long ldc) {
  if (M <= 0 || N <= 0) return 0;
  long panels = (N + KMG_NR - 1) / KMG_NR, K2 = (K + 1) / 2;
  if (K <= 0) {
    for (long m = 0; m < M; m++) memset(C + m * ldc, 0, sizeof(kmb_t) * N);
    return 0;
  }
  kmb_t *bscratch = NULL;
  if (!packed) {
    bscratch = (kmb_t *)aligned_alloc(64, sizeof(kmb_t) * (size_t)(panels * K2 * 2 * KMG_NR));
    if (!bscratch) return 1;
    kiln_mgemm_pack_b_bf16(K, N, B, bk, bn, bscratch);
    B = bscratch;
  }
  if (M <= KMBV_MAX_M) {
    kmbv_gemm(M, N, K, A, am, ak, B, C, ldc);
    free(bscratch);
    return 0;
  }
  long mc_max = M < KMG_MC ? M : KMG_MC, kc_max = K < KMG_KC ? K : KMG_KC;
  long mc_rounded = (mc_max + KMG_MR - 1) / KMG_MR * KMG_MR;
  size_t bytes = sizeof(kmb_a_t) * (size_t)(mc_rounded * (kc_max + 1));
  kmb_a_t *work = (kmb_a_t *)aligned_alloc(64, bytes);
  float *Cf = K > KMG_KC ? (float *)malloc(sizeof(float) * (size_t)(M * N)) : NULL;
  if (!work || (K > KMG_KC && !Cf)) { free(work); free(Cf); free(bscratch); return 1; }
  if (M >= KMG_SPLIT_MIN_M && N <= KMG_SPLIT_MAX_N) {
    /* row ranges per thread, as kiln_mgemm_f32 (196 x 768 @ 768 x 192 at 2 threads: 440 us
       with the shared blocks and their barriers, ~330 split) */
    int failed = 0;
    #pragma omp parallel reduction(|:failed)
    {
#ifdef _OPENMP
      long t = omp_get_thread_num(), T = omp_get_num_threads();
#else
      long t = 0, T = 1;
#endif
      long share = ((M + T - 1) / T + KMG_MR - 1) / KMG_MR * KMG_MR;
      long lo = t * share, hi = lo + share < M ? lo + share : M;
      kmb_a_t *mine = t == 0 ? work : (kmb_a_t *)aligned_alloc(64, bytes);
      if (!mine) failed = 1;
      else if (lo < hi) kmb_rows(lo, hi, N, K, A, am, ak, B, Cf, C, ldc, mine);
      if (mine && mine != work) free(mine);
    }
    free(Cf);
    free(work);
    free(bscratch);
    return failed;
  }
  #pragma omp parallel
  {
    for (long pc = 0; pc < K; pc += KMG_KC) {
      long kc = K - pc < KMG_KC ? K - pc : KMG_KC, kc2 = (kc + 1) / 2;
      for (long ic = 0; ic < M; ic += KMG_MC) {
        long mc = M - ic < KMG_MC ? M - ic : KMG_MC;
        long blocks = (mc + KMG_MR - 1) / KMG_MR;
        #pragma omp for schedule(static)
        for (long ib = 0; ib < blocks; ib++) kmb_pack_a(A, am, ak, ic, mc, ib, pc, kc, work + ib * KMG_MR * 2 * kc2);
        long units = (panels + KMB_UNIT_PANELS - 1) / KMB_UNIT_PANELS;
        #pragma omp for collapse(2) schedule(static)
        for (long u = 0; u < units; u++)
          for (long ib = 0; ib < blocks; ib++)
            kmb_unit(N, K, B, Cf, C, ldc, ic, mc, ib, u, pc, kc, work + ib * KMG_MR * 2 * kc2);
      }
    }
  }
  free(Cf);
  free(work);
  free(bscratch);
  return 0;
}
#else
int kiln_mgemm_bf16_available(void) { return 0; }
#endif
"""


def packed_shape_bf16(k: int, n: int) -> tuple[int, int, int]:
    """Shape of the pair panels of a ``K x N`` right operand: ``(panels, ceil(K/2), 32)``."""
    return (panel_count(n), (k + 1) // 2, PAIR_WIDTH)


def pack_pairs(b: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``b`` (``K x N``, any strides, any floating dtype) into ``out``
    (:func:`packed_shape_bf16`, bf16) as pair panels."""
    write_pairs(b, out)


@dataclass(frozen=True)
class Bf16Gemm:
    """The loaded bf16 library: ``address`` of ``kiln_mgemm_bf16`` for generated code, and a
    ctypes entry point for timing and tests."""

    lib: ctypes.CDLL
    address: int

    def gemm(self, m: int, n: int, k: int, a: int, am: int, ak: int, b: int, bk: int, bn: int, packed: bool,
             c: int, ldc: int) -> int:
        """One bf16 GEMM on raw pointers (``kiln_mgemm_bf16``; B in pair panels when ``packed``);
        returns 0, or 1 when its scratch memory could not be allocated (C not written, or only in part)."""
        return self.lib.kiln_mgemm_bf16(m, n, k, a, am, ak, b, bk, bn, int(packed), c, ldc)


def library(cache: CompileCache, cc: str) -> Bf16Gemm | None:
    """The bf16 GEMM for compiler ``cc`` from ``cache`` (built on a miss); ``None`` where the
    CPU has neither AVX-512 BF16 nor AVX2 + FMA, or it does not build."""
    return load(str(cache.directory) if cache.enabled else None, cc)


@functools.lru_cache(maxsize=8)
def load(directory: str | None, cc: str) -> Bf16Gemm | None:
    """:func:`library` by cache folder (``None``: uncached) and compiler."""
    found = load_gemm(directory, cc, SOURCE, "kiln_mgemm_bf16")  # absent without AVX-512 BF16 and AVX2
    return None if found is None else Bf16Gemm(*found)


__all__ = ["SOURCE", "Bf16Gemm", "library", "load", "pack_pairs", "packed_shape_bf16"]
