"""The AVX-512 kernel of kiln's fused CPU attention (:mod:`.attention` documents it), C source
spliced into :mod:`.attention_source`'s translation unit after the portable kernel's
helpers (it uses the ``KA_QT`` / ``KA_BK`` sizes defined there)."""

from __future__ import annotations

AVX512 = r"""#if defined(__AVX512F__)
/* ---------------------------------------------------------------- AVX-512 */
/* The same computation on 16-wide vectors, with the scores of a panel of KA_PR query rows
   and a block of KA_BK keys in registers: S = Q K^T is a 6 x 64 register tile (24
   accumulators, Q broadcast in place, K transposed once per task), masked, scaled and
   exponentiated there; only P is stored, row-major, and broadcast from memory into the
   P @ V product, whose 6 x 64 output tile is loaded, rescaled, accumulated and stored once
   per key block. */
#define KA_AVX512 1
#define KA_PR 6

/* 2^x on 16 lanes: x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-6 Taylor
   polynomial in f ln 2 (relative error ~2e-7), times 2^n by vscalefps (0 for a very negative
   x, with no clamping).  The scores are kept in base-2 units: scale * log2(e) is folded into
   the packed keys, so 2^(s - m) is the softmax's exp. */
static inline __m512 ka_exp2_16(__m512 x) {
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381608e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

static inline __mmask16 ka_lanes(long n) {  /* the first n lanes (n clamped to [0, 16]) */
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* One row's 64 scores at p (key j0 + j at p[j], already scaled to base 2), in place: the
   mask (keys from lim on unseen; a float mask added, times log2(e)), the online-softmax
   update of the running maximum *m and of the lane sums l[16], P stored over them; *corr is
   2^(old m - new m), by which the caller rescales the row's output. */
static inline void ka_row16(float *p, long lim, const void *mrow, int mkind, long ms, float *m, float *l,
                            float *corr) {
  __m512 sv[4] = {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16), _mm512_loadu_ps(p + 32), _mm512_loadu_ps(p + 48)};
  __m512 ninf = _mm512_set1_ps(-INFINITY), log2e = _mm512_set1_ps(1.44269504088896341f);
  __mmask16 valid[4];
  for (int c = 0; c < 4; c++) {
    valid[c] = ka_lanes(lim - 16 * c);
    __m512 x = sv[c];
    if (mkind == 2 && valid[c]) {
      const float *mr = (const float *)mrow + 16 * c * ms;
      __m512 add;
      if (ms == 1) add = _mm512_maskz_loadu_ps(valid[c], mr);
      else if (ms == 0) add = _mm512_set1_ps(mr[0]);
      else {
        float t[16];
        for (int u = 0; u < 16; u++) t[u] = 16 * c + u < lim ? mr[u * ms] : 0.0f;
        add = _mm512_loadu_ps(t);
      }
      x = _mm512_fmadd_ps(add, log2e, x);
      valid[c] &= _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    } else if (mkind == 1 && valid[c]) {
      const unsigned char *mr = (const unsigned char *)mrow + 16 * c * ms;
      __mmask16 keep = 0;
      if (ms == 0) keep = mr[0] ? (__mmask16)0xFFFF : 0;
      else if (ms == 1 && valid[c] == (__mmask16)0xFFFF) {
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)mr));
        keep = _mm512_test_epi32_mask(bytes, bytes);
      } else {
        for (int u = 0; u < 16; u++)
          if (16 * c + u < lim && mr[u * ms]) keep |= (__mmask16)(1u << u);
      }
      valid[c] &= keep;
    }
    sv[c] = _mm512_mask_mov_ps(ninf, valid[c], x);
  }
  float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(sv[0], sv[1]), _mm512_max_ps(sv[2], sv[3])));
  float mold = *m, mnew = mx > mold ? mx : mold;
  __m512 vm = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
  for (int c = 0; c < 4; c++) {  /* lanes not seen give 0 (and so does a row that saw nothing) */
    __m512 e = _mm512_maskz_mov_ps(valid[c], ka_exp2_16(_mm512_sub_ps(sv[c], vm)));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(p + 16 * c, e);
  }
  /* 0 where nothing was seen before (the sum and output are 0 anyway), 1 where the maximum held */
  __m512 cv = mold == -INFINITY ? _mm512_setzero_ps() : ka_exp2_16(_mm512_set1_ps(mold - mnew));
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), cv, sum));
  *m = mnew;
  *corr = _mm512_cvtss_f32(cv);
}

/* o[6][nv vectors from column c0] = o * corr + P[6][w] @ V[w][...]: the output tile of a panel,
   loaded, rescaled, accumulated over the block's w keys and stored once */
static inline __attribute__((always_inline)) void ka_pv16(int nv, long w, const float *p, const float *vt,
    long vs, float *o, long ldo, const float *corr, __mmask16 tail) {
  __m512 acc[KA_PR][4];
  for (int r = 0; r < KA_PR; r++) {
    __m512 cr = _mm512_set1_ps(corr[r]);
    for (int c = 0; c < nv; c++) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + 16 * c), cr);
  }
  for (long j = 0; j < w; j++) {
    const float *vr = vt + j * vs;
    __m512 vv[4];
    for (int c = 0; c < nv; c++) vv[c] = c == nv - 1 ? _mm512_maskz_loadu_ps(tail, vr + 16 * c) : _mm512_loadu_ps(vr + 16 * c);
    for (int r = 0; r < KA_PR; r++) {
      __m512 pr = _mm512_set1_ps(p[r * KA_BK + j]);
      for (int c = 0; c < nv; c++) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < KA_PR; r++)
    for (int c = 0; c < nv; c++) _mm512_storeu_ps(o + r * ldo + 16 * c, acc[r][c]);
}

/* The packed keys and values of a call: a buffer of the calling thread, grown as needed and
   kept (megabytes freshly mapped at every call cost more page faults than the packing itself) */
static __thread float *ka_pool_data;
static __thread size_t ka_pool_bytes;
static float *ka_pool(size_t bytes) {
  if (bytes > ka_pool_bytes) {
    free(ka_pool_data);
    size_t grown = (bytes + 4095) / 4096 * 4096;
    ka_pool_data = (float *)aligned_alloc(64, grown);
    ka_pool_bytes = ka_pool_data ? grown : 0;
  }
  return ka_pool_data;
}

/* s[6][16 nk] (row stride KA_BK) = Q[6][E] @ K^T[E][16 nk]: a panel's scores against the first
   16 nk keys of a block, in registers (Q broadcast in place; rows from pr on repeat row 0) */
static inline __attribute__((always_inline)) void ka_s16(int nk, long E, const float *qt, long ql, long pr,
                                                         const float *kblk, float *s) {
  __m512 acc[KA_PR][4];
  const float *qr[KA_PR];
  for (int r = 0; r < KA_PR; r++) {
    qr[r] = qt + (r < pr ? r : 0) * ql;
    for (int c = 0; c < nk; c++) acc[r][c] = _mm512_setzero_ps();
  }
  for (long e = 0; e < E; e++) {
    __m512 kv[4];
    for (int c = 0; c < nk; c++) kv[c] = _mm512_loadu_ps(kblk + e * KA_BK + 16 * c);
    for (int r = 0; r < KA_PR; r++) {
      __m512 x = _mm512_set1_ps(qr[r][e]);
      for (int c = 0; c < nk; c++) acc[r][c] = _mm512_fmadd_ps(x, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < KA_PR; r++)
    for (int c = 0; c < nk; c++) _mm512_storeu_ps(s + r * KA_BK + 16 * c, acc[r][c]);
}

/* bf16 <-> f32: a bf16 is the top half of an f32; stores round to nearest even (NaN kept) */
static inline float ka_bf2f(unsigned short h) {
  unsigned int u = (unsigned int)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline unsigned short ka_f2bf(float f) {
  unsigned int u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* element i of a float32 (bf == 0) or bfloat16 (bf == 1) array, as float */
static inline float ka_ld(const void *p, long i, int bf) {
  return bf ? ka_bf2f(((const unsigned short *)p)[i]) : ((const float *)p)[i];
}

/* one key/value head (its elements from offsets kt and vt, rows ks and vs apart) packed:
   K^T scaled by kscale into kp ([spad / KA_BK][E][KA_BK], zero past the S keys), V into vp
   ([S][evp]) */
static void ka_pack_head(const void *k, long kt, long ks, const void *v, long vt, long vs, long S, long E, long Ev,
                         float kscale, int bf, float *kp, float *vp) {
  long spad = (S + KA_BK - 1) / KA_BK * KA_BK, evp = (Ev + 15) / 16 * 16;
  for (long j = 0; j < spad; j++) {
    float *dst = kp + (j / KA_BK) * E * KA_BK + j % KA_BK;
    if (j < S) {
      for (long e = 0; e < E; e++) dst[e * KA_BK] = ka_ld(k, kt + j * ks + e, bf) * kscale;
    } else {
      for (long e = 0; e < E; e++) dst[e * KA_BK] = 0.0f;
    }
  }
  for (long j = 0; j < S; j++) {
    if (bf) for (long e = 0; e < Ev; e++) vp[j * evp + e] = ka_ld(v, vt + j * vs + e, 1);
    else memcpy(vp + j * evp, (const float *)v + vt + j * vs, sizeof(float) * (size_t)Ev);
  }
}

/* q, k, v and o are float32, or bfloat16 when bf (converted to f32 as they are packed, Q a
   tile at a time; the result rounded to bf16 as it is stored) */
static int ka_attention_512(long B, long H, long L, long S, long E, long Ev, long group,
                            const void *q, long qb, long qh, long ql,
                            const void *k, long kb, long kh, long ks,
                            const void *v, long vb, long vh, long vs,
                            const void *mask, int mkind, long mb, long mh, long ml, long ms,
                            int causal, float scale, void *o, long ob, long oh, long ol, int nthreads, int bf) {
  long tiles = (L + KA_QT - 1) / KA_QT;
  long kvh = H / group, kvheads = B * kvh;
  long evw = (Ev + 63) / 64 * 64;  /* accumulator row width: whole 64-column groups */
  long spad = (S + KA_BK - 1) / KA_BK * KA_BK;
  long evp = (Ev + 15) / 16 * 16;  /* packed V row: whole vectors */
  size_t msize = mkind == 1 ? 1 : 4;
  float kscale = scale * 1.44269504088896341f;  /* scores in base-2 units (ka_exp2_16) */
  if (B * H * tiles <= 0) return 0;
  /* Keys and values are packed -- K^T (scaled) in blocks of KA_BK keys, [spad / KA_BK][E][KA_BK],
     V's rows [S][evp] -- so both are read sequentially (rows of K^T a whole key column apart,
     or V's own row stride, can map a block's rows to a few cache sets).  With at least two
     heads per thread, a task is one head: the thread packs its keys and values into a buffer
     of its own (they stay in its cache) and runs all of its query tiles.  With fewer heads,
     every key/value head is packed once into one buffer the threads share, and a task is one
     (head, query tile), so that the threads split the tiles. */
  int shared = B * H < 2 * (long)nthreads;
  long tasks = shared ? B * H * tiles : B * H;
  size_t kstride = (size_t)spad * (size_t)(E > 0 ? E : 1), vstride = (size_t)spad * (size_t)evp + 16;
  float *kpall = 0, *vpall = 0;
  if (shared) {
    kpall = ka_pool(sizeof(float) * (kstride + vstride) * (size_t)kvheads);
    if (!kpall) return 1;
    vpall = kpall + kstride * (size_t)kvheads;
  }
  int failed = 0;
  #pragma omp parallel num_threads(nthreads) reduction(|:failed)
  {
    if (shared) {
      #pragma omp for schedule(static)
      for (long kvi = 0; kvi < kvheads; kvi++)
        ka_pack_head(k, (kvi / kvh) * kb + (kvi % kvh) * kh, ks, v, (kvi / kvh) * vb + (kvi % kvh) * vh, vs, S, E,
                     Ev, kscale, bf, kpall + kstride * (size_t)kvi, vpall + vstride * (size_t)kvi);
    }
    float *own = shared ? 0 : ka_pool(sizeof(float) * (kstride + vstride));  /* this thread's */
    float *acc = (float *)aligned_alloc(64, sizeof(float) * (size_t)((KA_QT + KA_PR) * evw)); /* [QT][evw] */
    float *qf = bf ? (float *)aligned_alloc(64, sizeof(float) * (size_t)(KA_QT * (E > 0 ? E : 1))) : 0;
    if (bf && !qf) { free(acc); acc = 0; }  /* a bf16 tile's Q in f32: [QT][E] */
    float pbuf[(KA_QT + KA_PR) * KA_BK] __attribute__((aligned(64)));  /* P of the tile's rows */
    float cbuf[KA_QT + KA_PR];                                           /* their rescale factors */
    float mrow[KA_QT + KA_PR], lrow[(KA_QT + KA_PR) * 16] __attribute__((aligned(64)));  /* l: lane sums */
    if (!shared && !own) { free(acc); acc = 0; }
    if (!acc) failed = 1;
    memset(pbuf, 0, sizeof pbuf);  /* the lanes past a short block's keys are read, then masked */
    /* shared: the threads work on the tiles of one head at a time (its keys and values stay
       in cache), its last tiles first (the longest, when causal) */
    #pragma omp for schedule(dynamic, 1)
    for (long task = 0; task < tasks; task++) {
      if (!acc) continue;
      long bh = shared ? task / tiles : task, b = bh / H, h = bh % H, kvi = b * kvh + h / group;
      long t_lo = shared ? tiles - 1 - task % tiles : 0, t_hi = shared ? t_lo + 1 : tiles;
      const float *kp, *vp;
      if (shared) {
        kp = kpall + kstride * (size_t)kvi;
        vp = vpall + vstride * (size_t)kvi;
      } else {
        ka_pack_head(k, b * kb + (h / group) * kh, ks, v, b * vb + (h / group) * vh, vs, S, E, Ev, kscale, bf,
                     own, own + kstride);
        kp = own;
        vp = own + kstride;
      }
      for (long tile = t_lo; tile < t_hi; tile++) {
        long i0 = tile * KA_QT;
        long rows = L - i0 < KA_QT ? L - i0 : KA_QT;
        long panels = (rows + KA_PR - 1) / KA_PR;
        for (long r = 0; r < panels * KA_PR; r++) mrow[r] = -INFINITY;
        memset(lrow, 0, sizeof(float) * 16 * (size_t)(panels * KA_PR));
        memset(acc, 0, sizeof(float) * (size_t)(panels * KA_PR * evw));
        long send = causal ? (i0 + rows < S ? i0 + rows : S) : S;
        const float *qtile = qf;
        long qld = E;
        if (bf) {
          for (long r = 0; r < rows; r++)
            for (long e = 0; e < E; e++) qf[r * E + e] = ka_ld(q, b * qb + h * qh + (i0 + r) * ql + e, 1);
        } else {
          qtile = (const float *)q + b * qb + h * qh + i0 * ql;
          qld = ql;
        }
        for (long j0 = 0; j0 < send; j0 += KA_BK) {
          long w = send - j0 < KA_BK ? send - j0 : KA_BK;
          const float *kblk = kp + (j0 / KA_BK) * E * KA_BK;
          for (long mp = 0; mp < panels; mp++) {
            long r0 = mp * KA_PR, pr = rows - r0 < KA_PR ? rows - r0 : KA_PR;
            if (causal && j0 > i0 + r0 + pr - 1) continue;  /* no row of this panel sees the block */
            const float *qt = qtile + r0 * qld;
            float *sp = pbuf + r0 * KA_BK;
            switch ((w + 15) / 16) {  /* only the vectors of keys the block has */
              case 4: ka_s16(4, E, qt, qld, pr, kblk, sp); break;
              case 3: ka_s16(3, E, qt, qld, pr, kblk, sp); break;
              case 2: ka_s16(2, E, qt, qld, pr, kblk, sp); break;
              default: ka_s16(1, E, qt, qld, pr, kblk, sp); break;
            }
            for (long r = 0; r < KA_PR; r++) {
              long i = i0 + r0 + r, lim = r < pr ? w : 0;
              if (causal && i - j0 + 1 < lim) lim = i - j0 + 1;
              const char *mr = mask ? (const char *)mask + msize * (size_t)(b * mb + h * mh + i * ml + j0 * ms) : 0;
              ka_row16(pbuf + (r0 + r) * KA_BK, lim, mr, mkind, ms, mrow + r0 + r, lrow + (r0 + r) * 16, cbuf + r0 + r);
            }
          }
          /* then P @ V, panel by panel: P was stored a whole pass earlier */
          for (long mp = 0; mp < panels; mp++) {
            long r0 = mp * KA_PR, pr = rows - r0 < KA_PR ? rows - r0 : KA_PR;
            if (causal && j0 > i0 + r0 + pr - 1) continue;
            float *ap = acc + r0 * evw;
            const float *pp = pbuf + r0 * KA_BK, *cr = cbuf + r0;
            for (long c0 = 0; c0 < Ev; c0 += 64) {
              long left = Ev - c0;
              int nv = left >= 64 ? 4 : (int)((left + 15) / 16);
              __mmask16 tail = ka_lanes(left - 16 * (nv - 1));
              const float *vc = vp + j0 * evp + c0;
              switch (nv) {
                case 4: ka_pv16(4, w, pp, vc, evp, ap + c0, evw, cr, tail); break;
                case 3: ka_pv16(3, w, pp, vc, evp, ap + c0, evw, cr, tail); break;
                case 2: ka_pv16(2, w, pp, vc, evp, ap + c0, evw, cr, tail); break;
                default: ka_pv16(1, w, pp, vc, evp, ap + c0, evw, cr, tail); break;
              }
            }
          }
        }
        long ot = b * ob + h * oh + i0 * ol;
        for (long r = 0; r < rows; r++) {
          float l = _mm512_reduce_add_ps(_mm512_loadu_ps(lrow + r * 16));
          float inv = l > 0.0f ? 1.0f / l : 0.0f;
          const float *ar = acc + r * evw;
          if (bf) {
            unsigned short *orow = (unsigned short *)o + ot + r * ol;
            for (long e = 0; e < Ev; e++) orow[e] = ka_f2bf(ar[e] * inv);
          } else {
            float *orow = (float *)o + ot + r * ol;
            #pragma omp simd
            for (long e = 0; e < Ev; e++) orow[e] = ar[e] * inv;
          }
        }
      }
    }
    free(acc);
    free(qf);
  }
  return failed;
}
#endif

/* The bfloat16 entry (q, k, v, o bf16; the mask as in kiln_attention_f32), on CPUs with
   AVX-512 only; kiln_attention_has_bf16() says whether this build has it. */
int kiln_attention_has_bf16(void) {
#ifdef KA_AVX512
  return 1;
#else
  return 0;
#endif
}

int kiln_attention_bf16(long B, long H, long L, long S, long E, long Ev, long group,
                        const void *q, long qb, long qh, long ql,
                        const void *k, long kb, long kh, long ks,
                        const void *v, long vb, long vh, long vs,
                        const void *mask, int mkind, long mb, long mh, long ml, long ms,
                        int causal, float scale, void *o, long ob, long oh, long ol, int nthreads) {
#ifdef KA_AVX512
  return ka_attention_512(B, H, L, S, E, Ev, group, q, qb, qh, ql, k, kb, kh, ks, v, vb, vh, vs, mask, mkind,
                          mb, mh, ml, ms, causal, scale, o, ob, oh, ol, nthreads, 1);
#else
  return 2;  /* not built for this CPU */
#endif
}
"""
"""Without ``__AVX512F__`` the preprocessor drops the kernel (the portable one runs) and the
bfloat16 entry returns 2, which ``kiln_attention_has_bf16`` announces."""

__all__ = ["AVX512"]
