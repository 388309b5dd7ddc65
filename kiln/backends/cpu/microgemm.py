"""kiln's own float32 (and bfloat16) GEMM: packed panels, a 6x16 (AVX2) or 12x32 (AVX-512) register micro-kernel, OpenMP.

``C[M,N] = A[M,K] @ B[K,N]`` is computed the way high-performance BLAS libraries do it
(Goto's algorithm), specialised for the shapes of inference (small M, weights known ahead):

* **B in panels.**  B is stored as ``ceil(N/16)`` panels of 16 columns, each ``K x 16``
  contiguous (:func:`pack_panels`; the last panel is zero-padded).  Weights are packed once,
  when the plan first runs, and again only when the parameter changes
  (a :class:`kiln.runtime.call_plan.PackStep` the cpu backend writes with
  :func:`kiln.backends.cpu.packing.write_panels`); other right operands are packed at
  every call into a scratch buffer (a cost of ``K*N`` copies beside ``M*K*N`` multiply-adds).
* **A in micro-panels.**  Per ``KC x MC`` block, A is copied into ``MR``-row micro-panels
  (6 rows, 12 with AVX-512) whose ``MR`` values for one ``k`` are adjacent, so the
  micro-kernel broadcasts from one stream.
* **The micro-kernel** keeps a 6x16 tile of C in twelve 8-wide registers (AVX2 + FMA: two
  loads and six broadcasts feed twelve fused multiply-adds per ``k``).  With AVX-512 a row
  of the tile is one 16-wide register, two adjacent panels are computed together and a
  micro-panel has 12 rows: a 12x32 tile in 24 of the 32 registers (two loads and twelve
  broadcasts feed 24 multiply-adds per ``k``, enough independent ones to hide their
  latency; the ``k`` loop is unrolled four times); the panel format is the same.  A 6x32
  tile ran the GEMMs of GPT-2 and the MLP 10-17% slower on the Xeon below.  Without AVX2
  a portable loop nest takes its place.
* **Few rows.**  With at most 4 rows of A (2 without AVX-512) the product is bound by
  reading B: each thread streams its own range of panels, four at a time, over all of K,
  reading A in place (no packing, blocks or barriers).  On a 2-vCPU AMD EPYC with AVX-512,
  ``1 x 1024 @ 1024 x 4096`` went from 199 to 125 us with B in cache and from 656 to 388
  us with it flushed; ``1 x 4096 @ 4096 x 1024`` from 295 to 140 and from 847 to 327 us.
* **Parallelism.**  Threads split the (panel, micro-panel) grid of each block statically;
  a thread's share is contiguous along the grid, so one B panel stays in its L1/L2 while
  the thread walks down the rows of A.  The packing of A is shared by the threads.  A tall,
  narrow product (``M >= 192``, ``N <= 1024``: a training step's ``(512, 1024) @ (1024,
  256)``) is split by rows instead: each thread takes a contiguous range of rows, packs
  its own A and reads all of B, with no barrier between blocks (narrow ``N`` leaves each
  block's grid too little work to share: 305-330 against 394-408 GFLOP/s at 2 threads on
  the Xeon below).

On the 2-core AMD EPYC (Zen 2, AVX2) development machine this runs the GEMMs of GPT-2 small
at ~185-190 GFLOP/s (2 threads), against ~120-135 GFLOP/s for torch's MKL ``sgemm``.  On a
2-vCPU Intel Xeon with AVX-512 (GPT-2/MLP shapes, M = 64-512): one thread 177-211 GFLOP/s
with the 12x32 tiles (172-191 with 6x32 ones, 97-116 with the AVX2 ones) against 129-222
for MKL; two threads 358-412 GFLOP/s against 313-400 for MKL (sgemm peak, MKL at 3072^3:
~439).

**bfloat16** GEMMs have their own library on the same tiles, :mod:`.microgemm_bf16`.

The C lives in one standalone shared object (:func:`library`), built once per compiler and
machine by the cpu backend's C toolchain and kept in the artifact cache (addressed by its
source and the compiler's identity); generated kernels call it through a function pointer
set after loading (``kiln_set_mgemm``), like the BLAS providers of :mod:`.gemm`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from typing import TYPE_CHECKING

from kiln.backends.common.toolchain import build_cached
from kiln.runtime.cache import CompileCache

from . import toolchain
from .packing import write_panels

if TYPE_CHECKING:
    from .microgemm_bf16 import Bf16Gemm

NR = 16
"""Columns of a B panel (and of the micro-kernel's tile)."""
MR = 6
"""Rows of an A micro-panel (and of the micro-kernel's tile) without AVX-512; 12 with it
(``KMG_MR`` in the C, chosen by the compiler's target)."""

PRELUDE = r"""
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KMG_AVX2 1
#if defined(__AVX512F__)
#define KMG_AVX512 1
#endif
#endif
/* Rows of an A micro-panel: 12 with AVX-512 (a 12x32 tile in 24 of the 32 registers), else 6
   (a 6x16 tile in 12 of AVX2's 16).  An includer may fix it first (the convolution kernels,
   whose in-place tile reads six rows). */
#ifndef KMG_MR
#ifdef KMG_AVX512
#define KMG_MR 12
#else
#define KMG_MR 6
#endif
#endif
#define KMG_NR 16
#define KMG_KC 256
#define KMG_SPLIT_MIN_M 192
#define KMG_SPLIT_MAX_N 1024
#if KMG_MR > 6
#define KMG_MC 144
#else
#define KMG_MC 96
#endif
/* fn1(...) .. fnMR(...) by the row count of a tile (KMG_MR: the full micro-panel) */
#define KMG_CASES6(fn, ...) case 1: fn##1(__VA_ARGS__); break; case 2: fn##2(__VA_ARGS__); break; \
    case 3: fn##3(__VA_ARGS__); break; case 4: fn##4(__VA_ARGS__); break; case 5: fn##5(__VA_ARGS__); break;
#if KMG_MR == 12
#define KMG_BY_ROWS(fn, rows, ...) switch (rows) { KMG_CASES6(fn, __VA_ARGS__) \
    case 6: fn##6(__VA_ARGS__); break; case 7: fn##7(__VA_ARGS__); break; case 8: fn##8(__VA_ARGS__); break; \
    case 9: fn##9(__VA_ARGS__); break; case 10: fn##10(__VA_ARGS__); break; case 11: fn##11(__VA_ARGS__); break; \
    default: fn##12(__VA_ARGS__); break; }
#elif KMG_MR == 6
#define KMG_BY_ROWS(fn, rows, ...) switch (rows) { KMG_CASES6(fn, __VA_ARGS__) default: fn##6(__VA_ARGS__); break; }
#else
#error "KMG_MR must be 6 or 12"
#endif
#ifdef KMG_AVX512
#define KMG_STEP 2
#else
#define KMG_STEP 1
#endif
"""
"""The includes and macros of kiln's GEMM sources: instruction sets, the tile's rows, blocks
(:mod:`.microgemm_bf16` starts with them too)."""

SOURCE = PRELUDE + r"""
/* B[K,N] (element (k,n) at B[k*sk + n*sn]) into panels Bp[p][k][16], zero-padded. */
void kiln_mgemm_pack_b(long K, long N, const float *B, long sk, long sn, float *Bp) {
  long panels = (N + KMG_NR - 1) / KMG_NR;
  #pragma omp parallel for schedule(static)
  for (long p = 0; p < panels; p++) {
    float *dst = Bp + p * K * KMG_NR;
    long n0 = p * KMG_NR, w = N - n0 < KMG_NR ? N - n0 : KMG_NR;
    for (long k = 0; k < K; k++) {
      for (long j = 0; j < w; j++) dst[k * KMG_NR + j] = B[k * sk + (n0 + j) * sn];
      for (long j = w; j < KMG_NR; j++) dst[k * KMG_NR + j] = 0.0f;
    }
  }
}

#ifdef KMG_AVX512
/* AVX-512: one 16-wide register per tile row; a pair of adjacent panels (32 columns, two
   registers per row: twelve accumulators, enough to hide the FMA latency) where it fits. */
#define KMG_DECL(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps();
#define KMG_FMA1(r) c##r##0 = _mm512_fmadd_ps(_mm512_set1_ps(ap[r]), b0, c##r##0);
#define KMG_FMA2(r) { __m512 a = _mm512_set1_ps(ap[r]); \
  c##r##0 = _mm512_fmadd_ps(a, b0, c##r##0); c##r##1 = _mm512_fmadd_ps(a, b1, c##r##1); }
#define KMG_LOAD1(r) c##r##0 = _mm512_loadu_ps(c + r * ldc);
#define KMG_LOAD2(r) c##r##0 = _mm512_loadu_ps(c + r * ldc); c##r##1 = _mm512_loadu_ps(c + r * ldc + 16);
#define KMG_STORE1(r) _mm512_storeu_ps(c + r * ldc, c##r##0);
#define KMG_STORE2(r) _mm512_storeu_ps(c + r * ldc, c##r##0); _mm512_storeu_ps(c + r * ldc + 16, c##r##1);
#define KMG_ROWS1(X) X(0)
#define KMG_ROWS2(X) X(0) X(1)
#define KMG_ROWS3(X) X(0) X(1) X(2)
#define KMG_ROWS4(X) X(0) X(1) X(2) X(3)
#define KMG_ROWS5(X) X(0) X(1) X(2) X(3) X(4)
#define KMG_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define KMG_ROWS7(X) KMG_ROWS6(X) X(6)
#define KMG_ROWS8(X) KMG_ROWS7(X) X(7)
#define KMG_ROWS9(X) KMG_ROWS8(X) X(8)
#define KMG_ROWS10(X) KMG_ROWS9(X) X(9)
#define KMG_ROWS11(X) KMG_ROWS10(X) X(10)
#define KMG_ROWS12(X) KMG_ROWS11(X) X(11)
#define KMG_TILE(R) \
static inline void kmg_tile##R(long kc, const float *ap, const float *bp, float *c, long ldc, int acc) { \
  KMG_ROWS##R(KMG_DECL) \
  if (acc) { KMG_ROWS##R(KMG_LOAD1) } \
  _Pragma("GCC unroll 4") for (long k = 0; k < kc; k++) { \
    __m512 b0 = _mm512_loadu_ps(bp); \
    KMG_ROWS##R(KMG_FMA1) \
    ap += KMG_MR; bp += KMG_NR; \
  } \
  KMG_ROWS##R(KMG_STORE1) \
} \
static inline void kmg_pair##R(long kc, const float *ap, const float *bp, const float *bq, float *c, long ldc, \
                               int acc) { \
  KMG_ROWS##R(KMG_DECL) \
  if (acc) { KMG_ROWS##R(KMG_LOAD2) } \
  _Pragma("GCC unroll 4") for (long k = 0; k < kc; k++) { \
    __m512 b0 = _mm512_loadu_ps(bp), b1 = _mm512_loadu_ps(bq); \
    KMG_ROWS##R(KMG_FMA2) \
    ap += KMG_MR; bp += KMG_NR; bq += KMG_NR; \
  } \
  KMG_ROWS##R(KMG_STORE2) \
}
KMG_TILE(1) KMG_TILE(2) KMG_TILE(3) KMG_TILE(4) KMG_TILE(5) KMG_TILE(6)
#if KMG_MR == 12
KMG_TILE(7) KMG_TILE(8) KMG_TILE(9) KMG_TILE(10) KMG_TILE(11) KMG_TILE(12)
#endif
static inline void kmg_tile(long rows, long kc, const float *ap, const float *bp, float *c, long ldc, int acc) {
  KMG_BY_ROWS(kmg_tile, rows, kc, ap, bp, c, ldc, acc)
}
#define KMG_PAIRS 1
/* c[rows][32] (+)= Ap @ [Bp | Bq]: two adjacent full panels at once */
static inline void kmg_pair(long rows, long kc, const float *ap, const float *bp, const float *bq, float *c,
                            long ldc, int acc) {
  KMG_BY_ROWS(kmg_pair, rows, kc, ap, bp, bq, c, ldc, acc)
}
#elif defined(KMG_AVX2)
#define KMG_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
#define KMG_FMA(r) { __m256 a = _mm256_broadcast_ss(ap + r); \
  c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0); c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1); }
#define KMG_LOAD(r) c##r##0 = _mm256_loadu_ps(c + r * ldc); c##r##1 = _mm256_loadu_ps(c + r * ldc + 8);
#define KMG_STORE(r) _mm256_storeu_ps(c + r * ldc, c##r##0); _mm256_storeu_ps(c + r * ldc + 8, c##r##1);
#define KMG_ROWS1(X) X(0)
#define KMG_ROWS2(X) X(0) X(1)
#define KMG_ROWS3(X) X(0) X(1) X(2)
#define KMG_ROWS4(X) X(0) X(1) X(2) X(3)
#define KMG_ROWS5(X) X(0) X(1) X(2) X(3) X(4)
#define KMG_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
/* c[R][16] (row stride ldc) (+)= Ap[kc][6] @ Bp[kc][16], rows 0..R-1 of the micro-panel only
   (a GEMV, M = 1, does one sixth of the multiply-adds of a full tile) */
#define KMG_TILE(R) \
static inline void kmg_tile##R(long kc, const float *ap, const float *bp, float *c, long ldc, int acc) { \
  KMG_ROWS##R(KMG_DECL) \
  if (acc) { KMG_ROWS##R(KMG_LOAD) } \
  for (long k = 0; k < kc; k++) { \
    __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8); \
    KMG_ROWS##R(KMG_FMA) \
    ap += KMG_MR; bp += KMG_NR; \
  } \
  KMG_ROWS##R(KMG_STORE) \
}
KMG_TILE(1) KMG_TILE(2) KMG_TILE(3) KMG_TILE(4) KMG_TILE(5) KMG_TILE(6)
static inline void kmg_tile(long rows, long kc, const float *ap, const float *bp, float *c, long ldc, int acc) {
  KMG_BY_ROWS(kmg_tile, rows, kc, ap, bp, c, ldc, acc)
}
#else
/* c[rows][16] (row stride ldc) (+)= Ap[kc][6] @ Bp[kc][16], rows 0..rows-1 */
static inline void kmg_tile(long rows, long kc, const float *ap, const float *bp, float *c, long ldc, int acc) {
  float t[KMG_MR][KMG_NR];
  for (long r = 0; r < rows; r++)
    for (int j = 0; j < KMG_NR; j++) t[r][j] = acc ? c[r * ldc + j] : 0.0f;
  for (long k = 0; k < kc; k++)
    for (long r = 0; r < rows; r++)
      for (int j = 0; j < KMG_NR; j++) t[r][j] += ap[k * KMG_MR + r] * bp[k * KMG_NR + j];
  for (long r = 0; r < rows; r++)
    for (int j = 0; j < KMG_NR; j++) c[r * ldc + j] = t[r][j];
}
#endif

/* A tile narrower than 16 columns (the last panel): through a tile in scratch. */
static void kmg_edge(long kc, const float *ap, const float *bp, float *c, long ldc, int acc, long rows, long w) {
  float t[KMG_MR * KMG_NR];
  kmg_tile(rows, kc, ap, bp, t, KMG_NR, 0);
  for (long r = 0; r < rows; r++)
    for (long j = 0; j < w; j++) c[r * ldc + j] = (acc ? c[r * ldc + j] : 0.0f) + t[r * KMG_NR + j];
}

/* Without scratch memory: a plain loop nest (slow, but never a wrong result). */
static void kmg_plain(long M, long N, long K, const float *A, long am, long ak, const float *B, long bk,
                      long bn, int packed, float *C, long ldc) {
  for (long m = 0; m < M; m++)
    for (long n = 0; n < N; n++) {
      float s = 0.0f;
      for (long k = 0; k < K; k++)
        s += A[m * am + k * ak] * (packed ? B[(n / KMG_NR) * K * KMG_NR + k * KMG_NR + n % KMG_NR]
                                          : B[k * bk + n * bn]);
      C[m * ldc + n] = s;
    }
}

/* micro-panel ib of A's rows [ic, ic + mc), K block [pc, pc + kc), into dst (zero rows past M) */
static inline __attribute__((always_inline)) void kmg_pack_a(const float *A, long am, long ak, long ic, long mc,
                                                             long ib, long pc, long kc, float *dst) {
  long rows = mc - ib * KMG_MR < KMG_MR ? mc - ib * KMG_MR : KMG_MR;
  const float *src = A + (ic + ib * KMG_MR) * am + pc * ak;
  for (long k = 0; k < kc; k++) {
    for (long r = 0; r < rows; r++) dst[k * KMG_MR + r] = src[r * am + k * ak];
    for (long r = rows; r < KMG_MR; r++) dst[k * KMG_MR + r] = 0.0f;
  }
}

/* C's tiles of unit u (KMG_STEP panels: a pair of full panels in one tile with AVX-512) and
   micro-panel ib (packed at ap) of the rows [ic, ic + mc), K block [pc, pc + kc) */
static inline __attribute__((always_inline)) void kmg_unit(long N, long K, const float *B, float *C, long ldc,
                                                           long ic, long mc, long ib, long u, long pc, long kc,
                                                           const float *ap) {
  long panels = (N + KMG_NR - 1) / KMG_NR;
  long m0 = ic + ib * KMG_MR, rows = mc - ib * KMG_MR < KMG_MR ? mc - ib * KMG_MR : KMG_MR;
  long p = u * KMG_STEP;
#ifdef KMG_PAIRS
  if (p + 1 < panels && N - (p + 1) * KMG_NR >= KMG_NR) {
    const float *bp = B + p * K * KMG_NR + pc * KMG_NR;
    kmg_pair(rows, kc, ap, bp, bp + K * KMG_NR, C + m0 * ldc + p * KMG_NR, ldc, pc > 0);
    return;
  }
#endif
  for (; p < panels && p < (u + 1) * KMG_STEP; p++) {
    const float *bp = B + p * K * KMG_NR + pc * KMG_NR;
    long n0 = p * KMG_NR, w = N - n0 < KMG_NR ? N - n0 : KMG_NR;
    float *c = C + m0 * ldc + n0;
    if (w == KMG_NR) kmg_tile(rows, kc, ap, bp, c, ldc, pc > 0);
    else kmg_edge(kc, ap, bp, c, ldc, pc > 0, rows, w);
  }
}

/* rows [m_lo, m_hi) of C = A @ Bp (B in panels), by one thread, with scratch `work` for one
   packed KMG_MC x KMG_KC block of A */
static void kmg_rows(long m_lo, long m_hi, long N, long K, const float *A, long am, long ak, const float *B,
                     float *C, long ldc, float *work) {
  long units = ((N + KMG_NR - 1) / KMG_NR + KMG_STEP - 1) / KMG_STEP;
  for (long ic = m_lo; ic < m_hi; ic += KMG_MC) {
    long mc = m_hi - ic < KMG_MC ? m_hi - ic : KMG_MC;
    long blocks = (mc + KMG_MR - 1) / KMG_MR;
    for (long pc = 0; pc < K; pc += KMG_KC) {
      long kc = K - pc < KMG_KC ? K - pc : KMG_KC;
      for (long ib = 0; ib < blocks; ib++) kmg_pack_a(A, am, ak, ic, mc, ib, pc, kc, work + ib * KMG_MR * kc);
      for (long u = 0; u < units; u++)
        for (long ib = 0; ib < blocks; ib++)
          kmg_unit(N, K, B, C, ldc, ic, mc, ib, u, pc, kc, work + ib * KMG_MR * kc);
    }
  }
}

/* ------------------------------------------------------------------ few rows: GEMV */
/* Up to KGV_MAX_M rows of A (a GEMV at M = 1, a decoder's few tokens) are bound by reading B:
   each thread streams its own contiguous range of panels, four at a time, over the whole of
   K, with A read in place (no packing, no K blocks, no barriers).  Written with GCC's vector
   types as wide as the machine's registers (KGV_W lanes: 16 with AVX-512, one register per
   panel row; 8 with AVX2, two; 4 in plain C), so one source serves every target.  A vector
   type wider than the registers is not an option: GCC keeps such values on the stack, and on
   an AVX2 machine the 16-lane version read B at 12 GB/s where this one reads 34 GB/s
   (1024 -> 4096 -> 1024 at batch 1, 2 threads). */
#ifdef KMG_AVX512
#define KGV_MAX_M 4
#define KGV_W 16
#elif defined(KMG_AVX2)
#define KGV_MAX_M 2
#define KGV_W 8
#else
#define KGV_MAX_M 2
#define KGV_W 4
#endif
#define KGV_VPP (KMG_NR / KGV_W)
typedef float kgv_v __attribute__((vector_size(KGV_W * 4), aligned(4)));

/* C[m][n0 .. n0 + 16*np) for m < M (M <= KGV_MAX_M) from np <= 4 panels starting at bp */
static inline __attribute__((always_inline)) void kgv_group(long M, long K, const float *A, long am, long ak,
                                                            const float *bp, long np, float *C, long ldc, long n0,
                                                            long N) {
  kgv_v acc[KGV_MAX_M][4 * KGV_VPP];
  for (int m = 0; m < KGV_MAX_M; m++)
    for (int j = 0; j < 4 * KGV_VPP; j++) acc[m][j] = (kgv_v){0};
  for (long k = 0; k < K; k++) {
    kgv_v b[4 * KGV_VPP];
    for (int j = 0; j < 4 * KGV_VPP; j++)
      if (j / KGV_VPP < np) b[j] = *(const kgv_v *)(bp + ((j / KGV_VPP) * K + k) * KMG_NR + (j % KGV_VPP) * KGV_W);
    for (int m = 0; m < KGV_MAX_M && m < M; m++) {
      float a = A[m * am + k * ak];
      for (int j = 0; j < 4 * KGV_VPP; j++)
        if (j / KGV_VPP < np) acc[m][j] += a * b[j];
    }
  }
  for (int m = 0; m < M; m++)
    for (int j = 0; j < np; j++) {
      long c0 = n0 + j * KMG_NR, w = N - c0 < KMG_NR ? N - c0 : KMG_NR;
      const float *row = (const float *)&acc[m][j * KGV_VPP];
      if (w == KMG_NR) memcpy(C + m * ldc + c0, row, sizeof(float) * KMG_NR);
      else for (long i = 0; i < w; i++) C[m * ldc + c0 + i] = row[i];
    }
}

/* C[M,N] = A @ Bp for M <= KGV_MAX_M, the threads splitting the panels */
static void kgv_gemm(long M, long N, long K, const float *A, long am, long ak, const float *Bp, float *C, long ldc) {
  long panels = (N + KMG_NR - 1) / KMG_NR;
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
      const float *bp = Bp + p * K * KMG_NR;
      if (M == 1 && np == 4) kgv_group(1, K, A, am, ak, bp, 4, C, ldc, p * KMG_NR, N);  /* the common case, */
      else kgv_group(M, K, A, am, ak, bp, np, C, ldc, p * KMG_NR, N);                  /* compiled apart */
    }
  }
}

/* C[M,N] (row stride ldc) = A @ B; A's element (m,k) at A[m*am + k*ak]; B packed (Bp) when
   packed, else its element (k,n) at B[k*bk + n*bn] (packed here into scratch).
   Returns 0, or 1 when scratch memory could not be allocated and the plain loops ran. */
int kiln_mgemm_f32(long M, long N, long K, const float *A, long am, long ak, const float *B, long bk,
                   long bn, int packed, float *C, long ldc) {
  if (M <= 0 || N <= 0) return 0;
  long panels = (N + KMG_NR - 1) / KMG_NR;
  if (K <= 0) {
    for (long m = 0; m < M; m++) memset(C + m * ldc, 0, sizeof(float) * N);
    return 0;
  }
  float *bscratch = NULL;
  const float *B0 = B;
  if (!packed) {
    bscratch = (float *)aligned_alloc(64, sizeof(float) * (size_t)(panels * K * KMG_NR));
    if (!bscratch) { kmg_plain(M, N, K, A, am, ak, B, bk, bn, packed, C, ldc); return 1; }
    kiln_mgemm_pack_b(K, N, B, bk, bn, bscratch);
    B = bscratch;
  }
  if (M <= KGV_MAX_M) {
    kgv_gemm(M, N, K, A, am, ak, B, C, ldc);
    free(bscratch);
    return 0;
  }
  long mc_max = M < KMG_MC ? M : KMG_MC;
  long kc_max = K < KMG_KC ? K : KMG_KC;
  long mc_rounded = (mc_max + KMG_MR - 1) / KMG_MR * KMG_MR;
  float *work = (float *)aligned_alloc(64, sizeof(float) * (size_t)(mc_rounded * kc_max));
  if (!work) {
    free(bscratch);
    kmg_plain(M, N, K, A, am, ak, B0, bk, bn, packed, C, ldc);
    return 1;
  }
  if (M >= KMG_SPLIT_MIN_M && N <= KMG_SPLIT_MAX_N) {
    /* row ranges per thread: no barriers, each thread packs its own A (see the docstring) */
    int failed = 0;
    #pragma omp parallel
    {
#ifdef _OPENMP
      long t = omp_get_thread_num(), T = omp_get_num_threads();
#else
      long t = 0, T = 1;
#endif
      long share = ((M + T - 1) / T + KMG_MR - 1) / KMG_MR * KMG_MR;
      long lo = t * share, hi = lo + share < M ? lo + share : M;
      float *mine = t == 0 ? work : (float *)aligned_alloc(64, sizeof(float) * (size_t)(mc_rounded * kc_max));
      if (!mine) {
        #pragma omp atomic write
        failed = 1;
      }
      else if (lo < hi) kmg_rows(lo, hi, N, K, A, am, ak, B, C, ldc, mine);
      if (mine && mine != work) free(mine);
    }
    if (failed) kmg_plain(M, N, K, A, am, ak, B0, bk, bn, packed, C, ldc);
    free(work);
    free(bscratch);
    return failed;
  }
  #pragma omp parallel
  {
    for (long pc = 0; pc < K; pc += KMG_KC) {
      long kc = K - pc < KMG_KC ? K - pc : KMG_KC;
      for (long ic = 0; ic < M; ic += KMG_MC) {
        long mc = M - ic < KMG_MC ? M - ic : KMG_MC;
        long blocks = (mc + KMG_MR - 1) / KMG_MR;
        #pragma omp for schedule(static)
        for (long ib = 0; ib < blocks; ib++) kmg_pack_a(A, am, ak, ic, mc, ib, pc, kc, work + ib * KMG_MR * kc);
        long units = (panels + KMG_STEP - 1) / KMG_STEP;
        #pragma omp for collapse(2) schedule(static)
        for (long u = 0; u < units; u++)
          for (long ib = 0; ib < blocks; ib++)
            kmg_unit(N, K, B, C, ldc, ic, mc, ib, u, pc, kc, work + ib * KMG_MR * kc);
      }
    }
  }
  free(work);
  free(bscratch);
  return 0;
}
"""


def panel_count(n: int) -> int:
    """How many 16-column panels hold ``n`` columns."""
    return (n + NR - 1) // NR


def packed_shape(k: int, n: int) -> tuple[int, int, int]:
    """Shape of the packed form of a ``K x N`` right operand: ``(panels, K, 16)``."""
    return (panel_count(n), k, NR)


def pack_panels(b: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``b`` (``K x N``, any strides) into ``out`` (:func:`packed_shape`) as panels."""
    write_panels(b, out)


@dataclass(frozen=True)
class MicroGemm:
    """The loaded standalone library: ``address`` of ``kiln_mgemm_f32`` for generated code,
    and ctypes entry points for timing and tests."""

    lib: ctypes.CDLL
    address: int
    directory: str | None = None
    """The artifact cache folder it was built in (``None``: not cached)."""
    cc: str = ""
    """The C compiler that built it."""

    def gemm(self, m: int, n: int, k: int, a: int, am: int, ak: int, b: int, bk: int, bn: int, packed: bool,
             c: int, ldc: int) -> None:
        """Run one GEMM on raw pointers (see ``kiln_mgemm_f32`` in :data:`SOURCE`)."""
        self.lib.kiln_mgemm_f32(m, n, k, a, am, ak, b, bk, bn, int(packed), c, ldc)

    @property
    def bf16(self) -> "Bf16Gemm | None":
        """kiln's bf16 GEMM (:mod:`.microgemm_bf16`), built by the same compiler on first use;
        ``None`` where the CPU has neither AVX-512 BF16 nor AVX2 + FMA, or it does not build."""
        from .microgemm_bf16 import load  # noqa: PLC0415 (it builds on this module's prelude)

        return load(self.directory, self.cc)


def library(cache: CompileCache, cc: str) -> MicroGemm | None:
    """The standalone GEMM library for compiler ``cc``, from ``cache`` (built on a miss);
    ``None`` when it cannot be built (then kiln's GEMM is simply not offered)."""
    return _load(str(cache.directory) if cache.enabled else None, cc)


def load_gemm(directory: str | None, cc: str, source: str, symbol: str) -> tuple[ctypes.CDLL, int] | None:
    """Build (or find in the cache folder ``directory``) the GEMM library ``source`` with the
    cpu toolchain of ``cc`` and load it: the library and the address of its entry ``symbol``
    (the signature of ``kiln_mgemm_f32``, element types aside), or ``None`` when it does not
    build or load."""
    cache = CompileCache(directory, enabled=directory is not None)
    try:
        entry = build_cached(toolchain.cpu_compiler(cc or None), source, cache, manifest={"kernels": []})
        lib = ctypes.CDLL(str(Path(entry.library)))
    except (OSError, toolchain.CompileError):
        return None
    fn = getattr(lib, symbol, None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                         ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_long]
    fn.restype = ctypes.c_int
    address = ctypes.cast(fn, ctypes.c_void_p).value
    return (lib, int(address)) if address else None


@functools.lru_cache(maxsize=8)
def _load(directory: str | None, cc: str) -> MicroGemm | None:
    found = load_gemm(directory, cc, SOURCE, "kiln_mgemm_f32")
    return None if found is None else MicroGemm(*found, directory, cc)


__all__ = ["MR", "NR", "PRELUDE", "SOURCE", "MicroGemm", "library", "load_gemm", "pack_panels", "packed_shape", "panel_count"]
