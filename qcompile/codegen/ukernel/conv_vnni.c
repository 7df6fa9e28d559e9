// Implicit-GEMM int8 convolution with the requantize epilogue fused, for x86-64 AVX-512 VNNI.
//
// u8 activations (NHWC, already padded by their zero point, channels padded to a multiple of 4)
// times s8 weights (pre-packed, see qcompile/codegen/ukernel/__init__.py: pack_weights) with
// vpdpbusd into i32, then qcompile's fixed-point requantize (qcompile/ir/qmath.py) in i64:
//
//   out = clamp(((acc + bias[c]) * m0[c] + res * m1[c] + add[c]) >> shift[c] + zp_out, lo, hi)
//
// or, for a dequantize (H_FLOAT), f32 out = float32((acc + bias[c]) * m0[c]) * p[c] (+ res, f32)
// with m0 the scale's 24-bit significand and p = 2^-sh (qmath.dequantize_array).
//
// where bias holds the folded zero-point terms and add = 2^(shift-1) - z_res * m1. All i64
// arithmetic wraps exactly like the reference's numpy int64, so the result is bit-exact.
//
// One call computes one chunk of output pixels of image n (H_CHUNK of them, flattened over the
// output rows) for one block of up to 64 output channels; IREE's workgroup grid is (channel
// blocks, chunks, N). A second entry, qk_matmul_u8s8, runs the same tiles
// as a batch of GEMMs (linears are 1x1 convs of the first entry): per-image weights packed at run
// time and the i32 zero-point terms of two run-time operands added before the requantize. Called through hal.executable objects with bare
// pointers: each buffer is (pointer, element offset).
//
// Built freestanding (no libc): gcc -O3 -mavx512f -mavx512bw -mavx512dq -mavx512vl
// -mavx512vnni -fPIC -ffreestanding -fno-stack-protector -c.

#include <immintrin.h>
#include <stdint.h>

enum {
  H_HP, H_WP, H_C, H_KH, H_KW, H_SH, H_SW, H_DH, H_DW, H_OH, H_OW, H_F, H_FP,
  H_RES, H_RES_SIGNED, H_ZOUT, H_QMIN, H_QMAX, H_N, H_WSTRIDE, H_CHUNK, H_YPT, H_YPL,
  H_YFILL, H_NARROW, H_RES_ZP, H_SIGNED, H_CLAMP_LO, H_CLAMP_HI, H_ZFOLD, H_FLOAT, H_LUT,
  H_XOFF, H_RPT, H_RPL, H_XSTEP, H_PAIR,
  HEADER = 37
};

#define INLINE static inline __attribute__((always_inline))

typedef struct {
  const uint8_t* x;        // the (n) image, padded
  const int8_t* w;         // this channel block's packed weights
  int64_t row;             // bytes per padded input row (WP * xstep)
  int64_t c, kh, kw, sw, dh, dw;
  int64_t xstep;           // bytes per input pixel: C, or fewer for packed rows (H_XSTEP)
} conv_args;

// Accumulators of MR output pixels x NR*16 channels; xs[m]: pixel m's window origin (the
// pixels of a tile may lie on different output rows).
//
// Pairs (pixel pairs, H_PAIR: F = 8 NR, NR 1 or 3): row m is the pair xs[m], xt[m] and its
// vectors hold 2F virtual channels: v < F is channel v of the first pixel, v >= F channel v - F
// of the second. Vector NR/2 holds the first pixel's last 8 channels in its low lanes and the
// second's first 8 in its high lanes (one blend of the two broadcasts), the vectors before it
// the first pixel's, after it the second's: every lane real, where one pixel alone would leave
// half a vector empty.
//
// FROMBUF (pairs == FROMBUF): the accumulators were formed elsewhere (the Winograd entry) and
// xs[m] points to pixel m's NR*16 i32 sums, the bias of the narrow epilogue (init) already in
// them; the tile loads them and the epilogue runs as for the others.
//
// STEM3 (pairs == STEM3): a kernel of 3 rows of 3 quads each, which lie one after another in
// the input (a 3x3 conv over C <= 4 channels, the model's first conv, or a 3-row conv over
// packed rows of 12 bytes), the loops unrolled: with 9 steps of 12 or 24 products the loop's
// bookkeeping was a fifth of its time.
enum { FROMBUF = 2, STEM3 = 3 };
// one step of an unpaired tile: each pixel's quad at xs[m] + at broadcast against the NR
// weight vectors wv
INLINE void dp_pixels(__m512i acc[6][4], const uint8_t* const* xs, int64_t at,
                      const __m512i* wv, int MR, int NR) {
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    const __m512i x0 = _mm512_set1_epi32(*(const int32_t*)(xs[m] + at));
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], x0, wv[j]);
  }
}

INLINE void tile(const conv_args* a, const uint8_t* const* xs, const uint8_t* const* xt,
                 __m512i acc[6][4], int MR, int NR, const int32_t* init, const int pairs) {
  if (pairs == FROMBUF) {
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j)
        acc[m][j] = _mm512_loadu_si512((const void*)((const int32_t*)xs[m] + 16 * j));
    return;
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      acc[m][j] = init ? _mm512_loadu_si512((const void*)(init + 16 * j)) : _mm512_setzero_si512();
  const int8_t* w = a->w;
  if (pairs == STEM3) {
#pragma GCC unroll 3
    for (int i = 0; i < 3; ++i) {
      const int64_t off = i * a->row;
#pragma GCC unroll 3
      for (int q = 0; q < 3; ++q) {
        __m512i wv[4];
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512((const void*)(w + 64 * j));
        w += 64 * NR;
        dp_pixels(acc, xs, off + 4 * q, wv, MR, NR);
      }
    }
    return;
  }
  const int64_t quads = a->c >> 2;
  for (int64_t i = 0; i < a->kh; ++i) {
    for (int64_t k = 0; k < a->kw; ++k) {
      const int64_t off = i * a->dh * a->row + k * a->dw * a->xstep;
      for (int64_t q = 0; q < quads; ++q) {
        __m512i wv[4];
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512((const void*)(w + 64 * j));
        w += 64 * NR;
        if (!pairs) {
          dp_pixels(acc, xs, off + 4 * q, wv, MR, NR);
          continue;
        }
#pragma GCC unroll 6
        for (int m = 0; m < MR; ++m) {
          const __m512i x0 = _mm512_set1_epi32(*(const int32_t*)(xs[m] + off + 4 * q));
          const __m512i x1 = _mm512_set1_epi32(*(const int32_t*)(xt[m] + off + 4 * q));
          const __m512i xm = _mm512_mask_blend_epi32((__mmask16)0xFF00, x0, x1);
#pragma GCC unroll 4
          for (int j = 0; j < NR; ++j)
            acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], j < NR / 2 ? x0 : j == NR / 2 ? xm : x1,
                                            wv[j]);
        }
      }
    }
  }
  if (pairs) {
    // (each accumulator in a register here: without this gcc 12 copied the pairs' lean form's
    // accumulators between registers and the stack on every quad, 1.3x slower)
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) __asm__("" : "+v"(acc[m][j]));
  }
}

typedef struct {
  const int64_t* bias;
  const int64_t* m0;
  const int64_t* m1;
  const int64_t* add;
  const int64_t* shift;
  int64_t zout, qmin, qmax;
  int res, res_signed, narrow, sat_signed, clamp_lo, clamp_hi, zfold;
  int nk;                    // the narrow epilogue's split k (T >> k in i32 lanes; 32 mostly)
  int fout;                  // f32 out (a dequantize), residual f32; else int8
  int32_t res_zp;
  const int32_t* lut;        // H_LUT: a 256-entry table applied to the int8 codes (i32)
  const uint8_t* lut8;       // the same as bytes (the AVX-512 VBMI lookup)
  int32_t lut_lo;            // the codes' dtype low end (the table's index base)
  const float* scale32;      // fout: 2^-sh per channel
  // the narrow epilogue's tables (see store16_narrow)
  const int32_t* bias32;
  const int32_t* m0_32;
  const int32_t* m0_odd;     // m0_32 one channel down: the odd channels in the even dwords
  const int32_t* m1_32;
  const int32_t* m1_odd;
  const int32_t* round32;
  const int32_t* sh32;
} epi_args;

INLINE __m512i requant8(__m512i acc64, __m512i res64, const epi_args* e, int64_t c, int res) {
  __m512i t = _mm512_mullo_epi64(_mm512_add_epi64(acc64, _mm512_loadu_si512(e->bias + c)),
                                 _mm512_loadu_si512(e->m0 + c));
  if (res) t = _mm512_add_epi64(t, _mm512_mullo_epi64(res64, _mm512_loadu_si512(e->m1 + c)));
  t = _mm512_add_epi64(t, _mm512_loadu_si512(e->add + c));
  t = _mm512_srav_epi64(t, _mm512_loadu_si512(e->shift + c));
  t = _mm512_add_epi64(t, _mm512_set1_epi64(e->zout));
  t = _mm512_max_epi64(t, _mm512_set1_epi64(e->qmin));
  return _mm512_min_epi64(t, _mm512_set1_epi64(e->qmax));
}

// The table of an elementwise op that follows the requantize (H_LUT: GELU's, ...) on 16 i32
// codes already clamped to the output range, stored as bytes: by vpermt2b where the object is
// built for AVX-512 VBMI, else by vpgatherdd.
INLINE void store16_lut(__m512i codes, const epi_args* e, uint8_t* y, __mmask16 mask) {
  const __m512i idx = _mm512_sub_epi32(codes, _mm512_set1_epi32(e->lut_lo));
#ifdef __AVX512VBMI__
  const __m512i b = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(idx));
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512((const void*)e->lut8), b,
                                              _mm512_loadu_si512((const void*)(e->lut8 + 64)));
  const __m512i hi = _mm512_permutex2var_epi8(
      _mm512_loadu_si512((const void*)(e->lut8 + 128)), b,
      _mm512_loadu_si512((const void*)(e->lut8 + 192)));
  const __m512i v = _mm512_mask_blend_epi8(_mm512_movepi8_mask(b), lo, hi);
  _mm_mask_storeu_epi8((void*)y, mask, _mm512_castsi512_si128(v));
#else
  const __m512i v = _mm512_i32gather_epi32(idx, (const void*)e->lut, 4);
  _mm_mask_storeu_epi8((void*)y, mask, _mm512_cvtepi32_epi8(v));
#endif
}

// the residual bytes of 16 channels (`mask`: the real ones): a plain load where all are (a
// masked load cost 3 % on a 3x3 conv with a residual)
INLINE __m128i res_bytes(const uint8_t* r, __mmask16 mask) {
  return mask == 0xFFFF ? _mm_loadu_si128((const __m128i*)r)
                        : _mm_maskz_loadu_epi8(mask, (const void*)r);
}

// 16 channels starting at c (of which `mask` are real) of one pixel.
INLINE void store16(__m512i acc, const epi_args* e, int64_t c, const uint8_t* r, uint8_t* y,
                    __mmask16 mask) {
  __m512i rlo = _mm512_setzero_si512(), rhi = rlo;
  if (e->res) {
    __m128i rb = res_bytes(r, mask);
    __m512i r32 = e->res_signed ? _mm512_cvtepi8_epi32(rb) : _mm512_cvtepu8_epi32(rb);
    rlo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(r32));
    rhi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(r32, 1));
  }
  __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc));
  __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1));
  lo = requant8(lo, rlo, e, c, e->res);
  hi = requant8(hi, rhi, e, c + 8, e->res);
  __m512i y32 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(lo)),
                                   _mm512_cvtepi64_epi32(hi), 1);
  if (e->lut)
    store16_lut(y32, e, y, mask);
  else
    _mm_mask_storeu_epi8((void*)y, mask, _mm512_cvtepi32_epi8(y32));
}

// The high halves of the 64-bit sums of the even (pe) and odd (po) lanes as 16 i32 lanes: one
// merge-masked vpshufd moves each even lane's high dword down into po's free even dwords.
INLINE __m512i high32(__m512i pe, __m512i po) {
  return _mm512_mask_shuffle_epi32(po, (__mmask16)0x5555, pe, _MM_PERM_DDBB);
}

// T >> k of the 64-bit sums of the even (pe) and odd (po) lanes as 16 i32 lanes (k < 32: a
// residual term with a multiplier near 1 sets the shift to 30-31; pack_params.narrow_shift)
INLINE __m512i high_k(__m512i pe, __m512i po, __m128i k, __m128i kl) {
  return _mm512_mask_blend_epi32((__mmask16)0xAAAA, _mm512_srl_epi64(pe, k),
                                 _mm512_sll_epi64(po, kl));
}

// The same requantize with 32-bit lanes where it is exact (pack_params: every acc + bias fits in
// i32, multipliers below 2^31, shifts >= 33). vpmuldq forms the 64-bit products of the even and
// of the odd channels (m0_odd holds the odd channels' multipliers in the even dwords it reads),
// and since floor shifts compose, (T + 2^(s-1)) >> s == ((T >> 32) + 2^(s-33)) >> (s-32): only
// the high halves of the sums T go on, as i32 (or T >> k for a k < 32: high_k). The bias is already in the accumulator (the
// tile starts from it). The saturating store makes the clamps that the range of the output
// type implies.
INLINE void store16_narrow(__m512i v, const epi_args* e, int64_t c, const uint8_t* r,
                           uint8_t* y, __mmask16 mask) {
  __m512i pe = _mm512_mul_epi32(v, _mm512_loadu_si512((const void*)(e->m0_32 + c)));
  __m512i po = _mm512_mul_epi32(_mm512_srli_epi64(v, 32),
                                _mm512_loadu_si512((const void*)(e->m0_odd + c)));
  if (e->res) {
    __m128i rb = res_bytes(r, mask);
    __m512i r32 = e->res_signed ? _mm512_cvtepi8_epi32(rb) : _mm512_cvtepu8_epi32(rb);
    r32 = _mm512_sub_epi32(r32, _mm512_set1_epi32(e->res_zp));
    pe = _mm512_add_epi64(pe, _mm512_mul_epi32(
        r32, _mm512_loadu_si512((const void*)(e->m1_32 + c))));
    po = _mm512_add_epi64(po, _mm512_mul_epi32(
        _mm512_srli_epi64(r32, 32), _mm512_loadu_si512((const void*)(e->m1_odd + c))));
  }
  __m512i t = e->nk == 32 ? high32(pe, po)
                          : high_k(pe, po, _mm_cvtsi32_si128(e->nk),
                                   _mm_cvtsi32_si128(32 - e->nk));
  t = _mm512_add_epi32(t, _mm512_loadu_si512((const void*)(e->round32 + c)));
  t = _mm512_srav_epi32(t, _mm512_loadu_si512((const void*)(e->sh32 + c)));
  if (!e->zfold) t = _mm512_add_epi32(t, _mm512_set1_epi32((int32_t)e->zout));
  if (e->lut) {                  // the table reads the clamped codes
    t = _mm512_max_epi32(t, _mm512_set1_epi32((int32_t)e->qmin));
    t = _mm512_min_epi32(t, _mm512_set1_epi32((int32_t)e->qmax));
    store16_lut(t, e, y, mask);
    return;
  }
  if (e->clamp_lo) t = _mm512_max_epi32(t, _mm512_set1_epi32((int32_t)e->qmin));
  if (e->clamp_hi) t = _mm512_min_epi32(t, _mm512_set1_epi32((int32_t)e->qmax));
  if (e->sat_signed)
    _mm512_mask_cvtsepi32_storeu_epi8((void*)y, mask, t);
  else
    _mm512_mask_cvtusepi32_storeu_epi8((void*)y, mask, t);
}

// A dequantize: float32((acc + bias) * m) * 2^-sh, then plus the f32 residual. The product by
// a power of two is exact, so the add rounds the same whether or not it is contracted.
INLINE void store16_float(__m512i acc, const epi_args* e, int64_t c, const uint8_t* r,
                          uint8_t* y, __mmask16 mask) {
  __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc));
  __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1));
  lo = _mm512_mullo_epi64(_mm512_add_epi64(lo, _mm512_loadu_si512(e->bias + c)),
                          _mm512_loadu_si512(e->m0 + c));
  hi = _mm512_mullo_epi64(_mm512_add_epi64(hi, _mm512_loadu_si512(e->bias + c + 8)),
                          _mm512_loadu_si512(e->m0 + c + 8));
  __m512 f = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtepi64_ps(lo)),
                                _mm512_cvtepi64_ps(hi), 1);
  f = _mm512_mul_ps(f, _mm512_loadu_ps(e->scale32 + c));
  if (e->res) f = _mm512_add_ps(f, _mm512_maskz_loadu_ps(mask, (const float*)r));
  _mm512_mask_storeu_ps((void*)y, mask, f);
}

// The narrow requantize of 16 channels with its per-channel tables held in registers across
// the pixels of a tile or row ("lean": no residual, no table, int8 out; store16_narrow's
// result).
typedef struct {
  __m512i m0e, m0o, m1e, m1o, rnd, sh, zo, lo, hi, rzp;
  __m128i k, kl;           // the split k and 32 - k (LEAN_K)
  int rs;                  // the residual is s8
} rq_regs;

enum { LEAN = 1, LEAN_RES = 2, LEAN_K = 4 };   // the lean form's variants (bits)

INLINE rq_regs rq_at(const epi_args* e, int64_t c0) {
  rq_regs q;
  q.m0e = _mm512_loadu_si512((const void*)(e->m0_32 + c0));
  q.m0o = _mm512_loadu_si512((const void*)(e->m0_odd + c0));
  q.m1e = _mm512_loadu_si512((const void*)(e->m1_32 + c0));
  q.m1o = _mm512_loadu_si512((const void*)(e->m1_odd + c0));
  q.rnd = _mm512_loadu_si512((const void*)(e->round32 + c0));
  q.sh = _mm512_loadu_si512((const void*)(e->sh32 + c0));
  q.zo = _mm512_set1_epi32(e->zfold ? 0 : (int32_t)e->zout);
  q.lo = _mm512_set1_epi32((int32_t)e->qmin);
  q.hi = _mm512_set1_epi32((int32_t)e->qmax);
  q.rzp = _mm512_set1_epi32(e->res_zp);
  q.k = _mm_cvtsi32_si128(e->nk);
  q.kl = _mm_cvtsi32_si128(32 - e->nk);
  q.rs = e->res_signed;
  return q;
}

// the lean form's variant for these epilogue parameters (0: not lean)
INLINE int lean_mode(const epi_args* e) {
  if (!e->narrow || e->lut || e->fout) return 0;
  return LEAN | (e->res ? LEAN_RES : 0) | (e->nk != 32 ? LEAN_K : 0);
}

// the lean requantize of 16 channels up to the shift: the codes before the output zero point
INLINE __m512i rq16_lean(__m512i v, const rq_regs* q, const uint8_t* r, __mmask16 mask,
                         const int mode) {
  __m512i pe = _mm512_mul_epi32(v, q->m0e);
  __m512i po = _mm512_mul_epi32(_mm512_srli_epi64(v, 32), q->m0o);
  if (mode & LEAN_RES) {
    const __m128i rb = res_bytes(r, mask);
    __m512i r32 = q->rs ? _mm512_cvtepi8_epi32(rb) : _mm512_cvtepu8_epi32(rb);
    r32 = _mm512_sub_epi32(r32, q->rzp);
    pe = _mm512_add_epi64(pe, _mm512_mul_epi32(r32, q->m1e));
    po = _mm512_add_epi64(po, _mm512_mul_epi32(_mm512_srli_epi64(r32, 32), q->m1o));
  }
  __m512i t = (mode & LEAN_K) ? high_k(pe, po, q->k, q->kl)
                              : high32(pe, po);
  return _mm512_srav_epi32(_mm512_add_epi32(t, q->rnd), q->sh);
}

INLINE void store16_lean(__m512i v, const rq_regs* q, const uint8_t* r, uint8_t* y,
                         __mmask16 mask, const int mode) {
  __m512i t = rq16_lean(v, q, r, mask, mode);
  t = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(t, q->zo), q->lo), q->hi);
  _mm_mask_storeu_epi8((void*)y, mask, _mm512_cvtepi32_epi8(t));
}

// 64 channels of one pixel from their four vectors of codes before the zero point: packed with
// saturation to i16 (the zero point added there, saturating) and to int8, clamped as bytes, one
// store. Saturation and the clamps are monotone and [qmin, qmax] lies inside the int8 range, so
// this equals clamping the i32 sums. The packs work per 128-bit lane: vpermd restores the order.
typedef struct {
  __m512i zo16, lo8, hi8, order;
  int s8;
  int zo, lo, hi;        // which of the zero point and the two clamps are not no-ops
} pack_regs;

INLINE pack_regs pack_at(const epi_args* e) {
  pack_regs k;
  const int64_t zo = e->zfold ? 0 : e->zout;
  k.zo16 = _mm512_set1_epi16((int16_t)zo);
  k.lo8 = _mm512_set1_epi8((char)e->qmin);
  k.hi8 = _mm512_set1_epi8((char)e->qmax);
  k.order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  k.s8 = e->sat_signed;
  k.zo = zo != 0;
  // the byte packs saturate to the int8 or uint8 range; clamps inside it remain
  k.lo = e->qmin > (k.s8 ? -128 : 0);
  k.hi = e->qmax < (k.s8 ? 127 : 255);
  return k;
}

// the packed bytes of four vectors of codes (before the zero point), per 128-bit lane
INLINE __m512i pack64_lean(__m512i a, __m512i b, __m512i c, __m512i d, const pack_regs* k) {
  __m512i ab = _mm512_packs_epi32(a, b), cd = _mm512_packs_epi32(c, d), v;
  if (k->zo) {
    ab = _mm512_adds_epi16(ab, k->zo16);
    cd = _mm512_adds_epi16(cd, k->zo16);
  }
  if (k->s8) {
    v = _mm512_packs_epi16(ab, cd);
    if (k->lo) v = _mm512_max_epi8(v, k->lo8);
    if (k->hi) v = _mm512_min_epi8(v, k->hi8);
  } else {
    v = _mm512_packus_epi16(ab, cd);
    if (k->lo) v = _mm512_max_epu8(v, k->lo8);
    if (k->hi) v = _mm512_min_epu8(v, k->hi8);
  }
  return v;
}

// The first n channels (16 NR at most) of one pixel from its NR vectors of codes, packed to
// bytes in one group of 64 (a block of fewer vectors repeats them, which the packs do once).
INLINE void store_packed(const __m512i* v, const int NR, const pack_regs* k, uint8_t* y,
                         int64_t n) {
  const __m512i a = v[0], b = NR > 1 ? v[1] : a, c = NR > 2 ? v[2] : a;
  const __m512i d = NR > 3 ? v[3] : NR > 2 ? c : b;
  const __m512i p = _mm512_permutexvar_epi32(k->order, pack64_lean(a, b, c, d, k));
  if (n >= 64)
    _mm512_storeu_si512((void*)y, p);
  else if (n == 32)
    _mm256_storeu_si256((__m256i*)y, _mm512_castsi512_si256(p));
  else if (n == 16)
    _mm_storeu_si128((__m128i*)y, _mm512_castsi512_si128(p));
  else
    _mm512_mask_storeu_epi8((void*)y, (__mmask64)((1ULL << n) - 1), p);
}


// Per-pixel and per-channel i32 terms added to the accumulators before the requantize (the
// zero-point corrections of a matmul whose operands are both run-time values); 0 for convs.
typedef struct {
  const int32_t* row;      // this tile's first pixel
  const int32_t* col;      // this image's channels (fp of them)
} terms_args;

// the mask of 16 lanes whose first `left` hold real channels (or elements); none when left <= 0
INLINE __mmask16 live16(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF
                    : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

// a matmul's per-channel terms of channels c.. (zeros for a conv), and an accumulator of
// pixel m with its pixel and channel terms added
INLINE __m512i terms_col(const terms_args* t, int64_t c) {
  return t ? _mm512_loadu_si512((const void*)(t->col + c)) : _mm512_setzero_si512();
}

INLINE __m512i with_terms(__m512i v, const terms_args* t, int m, __m512i col) {
  return t ? _mm512_add_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(t->row[m])), col) : v;
}

// A tile (tile()) and its epilogue: MR pixels (or pixel pairs, xt) x NR*16 channels from c0
// of f, each pixel's (pair's) outputs and residual at ys[m] and rs[m].
INLINE void run_tile(const conv_args* a, const epi_args* e, const terms_args* t,
                     const uint8_t* const* xs, const uint8_t* const* xt, int64_t c0, int64_t f,
                     const uint8_t* const* rs, uint8_t* const* ys, int MR, int NR,
                     const int lean, const int pairs) {
  __m512i acc[6][4];
  tile(a, xs, xt, acc, MR, NR, e->narrow ? e->bias32 + c0 : 0, pairs);
  if (lean) {             // the tables of each 16 channels once for the tile's pixels
    const int64_t real = f - c0 < 16 * NR ? f - c0 : 16 * NR;   // channels of this block
    if (real > 16 * (NR - 1)) {
      // every vector holds real channels: the codes first, then per pixel one packed store
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const int64_t c = c0 + 16 * j;
        const __mmask16 mask = live16(real - 16 * j);
        const rq_regs q = rq_at(e, c);
        const __m512i col = terms_col(t, c);
#pragma GCC unroll 6
        for (int m = 0; m < MR; ++m)
          acc[m][j] = rq16_lean(with_terms(acc[m][j], t, m, col), &q,
                                rs ? rs[m] + 16 * j : 0, mask, lean);
      }
      const pack_regs k = pack_at(e);
#pragma GCC unroll 6
      for (int m = 0; m < MR; ++m) store_packed(acc[m], NR, &k, ys[m], real);
      return;
    }
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const int64_t c = c0 + 16 * j;
      const __mmask16 mask = live16(f - c);
      const rq_regs q = rq_at(e, c);
      const __m512i col = terms_col(t, c);
#pragma GCC unroll 6
      for (int m = 0; m < MR; ++m)
        store16_lean(with_terms(acc[m][j], t, m, col), &q, rs ? rs[m] + 16 * j : 0,
                     ys[m] + 16 * j, mask, lean);
    }
    return;
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const int64_t c = c0 + 16 * j;
      // a matmul's blocks are 64 channels wide (packed at run time): none may be left
      const __mmask16 mask = live16(f - c);
      const __m512i v = with_terms(acc[m][j], t, m, terms_col(t, c));
      const uint8_t* r = rs ? rs[m] + (e->fout ? 4 : 1) * 16 * j : 0;
      if (e->fout)
        store16_float(v, e, c, r, ys[m] + 4 * 16 * j, mask);
      else if (e->narrow)
        store16_narrow(v, e, c, r, ys[m] + 16 * j, mask);
      else
        store16(v, e, c, r, ys[m] + 16 * j, mask);
    }
}

#define TILE_RUN(MR, NR, L, P) run_tile(a, e, t, xs, 0, c0, f, rs, ys, MR, NR, L, P)
#define TILE_CASE(MR, NR, P)                                                               \
  case MR:                                                                                \
    switch (lean) {                                                                       \
      case LEAN: TILE_RUN(MR, NR, LEAN, P); break;                                        \
      case LEAN | LEAN_RES: TILE_RUN(MR, NR, LEAN | LEAN_RES, P); break;                  \
      case LEAN | LEAN_K: TILE_RUN(MR, NR, LEAN | LEAN_K, P); break;                      \
      case LEAN | LEAN_RES | LEAN_K: TILE_RUN(MR, NR, LEAN | LEAN_RES | LEAN_K, P); break; \
      default: TILE_RUN(MR, NR, 0, P); break;                                             \
    }                                                                                     \
    break;
// A whole tile of 6 pixels (or 6 pixel pairs: PAIRS, xt) for each block width and epilogue
// form, a function of its own (the chunk loop calls it without a switch per tile)
typedef void (*tile6_fn)(const conv_args*, const epi_args*, const terms_args*,
                         const uint8_t* const*, const uint8_t* const*, int64_t, int64_t,
                         const uint8_t* const*, uint8_t* const*);
#define TILE6(NR, LEAN_MODE, PAIRS, NAME)                                                 \
  static __attribute__((noinline)) void NAME(                                             \
      const conv_args* a, const epi_args* e, const terms_args* t, const uint8_t* const* xs, \
      const uint8_t* const* xt, int64_t c0, int64_t f, const uint8_t* const* rs,          \
      uint8_t* const* ys) {                                                               \
    run_tile(a, e, t, xs, xt, c0, f, rs, ys, 6, NR, LEAN_MODE, PAIRS);                    \
  }
#define TILE6_NR(NR, PAIRS, P)                                                            \
  TILE6(NR, 0, PAIRS, tile6##P##_##NR##_0)                                                \
  TILE6(NR, LEAN, PAIRS, tile6##P##_##NR##_1)                                             \
  TILE6(NR, LEAN | LEAN_RES, PAIRS, tile6##P##_##NR##_3)                                  \
  TILE6(NR, LEAN | LEAN_K, PAIRS, tile6##P##_##NR##_5)                                    \
  TILE6(NR, LEAN | LEAN_RES | LEAN_K, PAIRS, tile6##P##_##NR##_7)
TILE6_NR(1, 0, )
TILE6_NR(2, 0, )
TILE6_NR(3, 0, )
TILE6_NR(4, 0, )
TILE6_NR(1, 1, p)
TILE6_NR(3, 1, p)
TILE6_NR(4, FROMBUF, b)
TILE6(2, LEAN, STEM3, tile6s_2_1)
TILE6(4, LEAN, STEM3, tile6s_4_1)
// [NR - 1][lean]: the lean form's bits index it (LEAN_RES and LEAN_K come with LEAN)
static const tile6_fn TILE6_FNS[4][8] = {
    {tile6_1_0, tile6_1_1, 0, tile6_1_3, 0, tile6_1_5, 0, tile6_1_7},
    {tile6_2_0, tile6_2_1, 0, tile6_2_3, 0, tile6_2_5, 0, tile6_2_7},
    {tile6_3_0, tile6_3_1, 0, tile6_3_3, 0, tile6_3_5, 0, tile6_3_7},
    {tile6_4_0, tile6_4_1, 0, tile6_4_3, 0, tile6_4_5, 0, tile6_4_7}};
// pixel pairs (H_PAIR: F = 8 or 24, 1 or 3 vectors): [NR / 2][lean]
static const tile6_fn TILE6P_FNS[2][8] = {
    {tile6p_1_0, tile6p_1_1, 0, tile6p_1_3, 0, tile6p_1_5, 0, tile6p_1_7},
    {tile6p_3_0, tile6p_3_1, 0, tile6p_3_3, 0, tile6p_3_5, 0, tile6p_3_7}};
// accumulators from a buffer (FROMBUF: the Winograd entry; 64-channel blocks): [lean]
static const tile6_fn TILE6B_FNS[8] = {tile6b_4_0, tile6b_4_1, 0, tile6b_4_3, 0, tile6b_4_5, 0,
                                       tile6b_4_7};

// n bytes (up to a few hundred) from s to d
INLINE void copy_bytes(uint8_t* d, const uint8_t* s, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) {
    const int64_t k = n - i < 64 ? n - i : 64;
    const __mmask64 m = k == 64 ? ~(__mmask64)0 : (((__mmask64)1 << k) - 1);
    _mm512_mask_storeu_epi8((void*)(d + i), m, _mm512_maskz_loadu_epi8(m, (const void*)(s + i)));
  }
}

// a short tile (mr < 6 pixels: a chunk's last), through a switch on mr and the form
#define TILES(NR, P, NAME)                                                                \
  static void NAME(const conv_args* a, const epi_args* e, const terms_args* t,            \
                         const uint8_t* const* xs, int64_t c0, int64_t f,                 \
                         const uint8_t* const* rs, uint8_t* const* ys, int mr, int lean) { \
    switch (mr) {                                                                         \
      TILE_CASE(1, NR, P) TILE_CASE(2, NR, P) TILE_CASE(3, NR, P) TILE_CASE(4, NR, P)     \
      TILE_CASE(5, NR, P)                                                                 \
    }                                                                                     \
  }
TILES(1, 0, tiles_1)
TILES(2, 0, tiles_2)
TILES(3, 0, tiles_3)
TILES(4, 0, tiles_4)
TILES(4, FROMBUF, tiles_b4)

// The epilogue's parameters from the header h (pack_params): its scalars, then the per-channel
// tables of fp channels each.
INLINE void epi_init(const int64_t* h, epi_args* e) {
  const int64_t fp = h[H_FP];
  const int64_t* per = h + HEADER;
  e->bias = per; e->m0 = per + fp; e->m1 = per + 2 * fp; e->add = per + 3 * fp;
  e->shift = per + 4 * fp;
  e->zout = h[H_ZOUT]; e->qmin = h[H_QMIN]; e->qmax = h[H_QMAX];
  e->res = (int)h[H_RES]; e->res_signed = (int)h[H_RES_SIGNED];
  e->narrow = h[H_NARROW] != 0;
  e->nk = (int)h[H_NARROW];
  e->res_zp = (int32_t)h[H_RES_ZP];
  e->sat_signed = (int)h[H_SIGNED];
  e->clamp_lo = (int)h[H_CLAMP_LO]; e->clamp_hi = (int)h[H_CLAMP_HI];
  e->zfold = (int)h[H_ZFOLD];        // the output zero point is in round32
  e->fout = (int)h[H_FLOAT];
  const int64_t* nt = per + 5 * fp;        // the narrow tables (pack_params)
  e->scale32 = (const float*)nt;            // a dequantize's 2^-sh (the narrow tables' place)
  e->bias32 = (const int32_t*)nt;
  e->m0_32 = e->bias32 + fp;
  e->m0_odd = e->m0_32 + fp;
  e->m1_32 = e->m0_odd + fp;
  e->m1_odd = e->m1_32 + fp;
  e->round32 = e->m1_odd + fp;
  e->sh32 = e->round32 + fp;
  // H_LUT: after the narrow tables, the table's index base (i64), 256 i32 entries, 256 bytes
  const int64_t* lt = nt + 7 * fp / 2;
  e->lut = h[H_LUT] ? (const int32_t*)(lt + 1) : 0;
  e->lut8 = (const uint8_t*)(lt + 1 + 128);
  e->lut_lo = h[H_LUT] ? (int32_t)lt[0] : 0;
}

// The output's border (H_YPT, H_YPL, H_YFILL) next to the output rows r0 .. r1 - 1: their left
// columns (left), their right columns (right), the top rows (top), the bottom rows (bottom)
static void fill_edges(const int64_t* h, uint8_t* ybase, int64_t c0, int64_t r0, int64_t r1,
                       int left, int right, int top, int bottom) {
  const int64_t pt = h[H_YPT], pl = h[H_YPL], ow = h[H_OW], f = h[H_F], ohn = h[H_OH];
  const int64_t owp = ow + 2 * pl;
  const __m512i fill = _mm512_set1_epi8((char)h[H_YFILL]);
  const int64_t lf = f - c0;
  const __mmask64 mask = lf >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << lf) - 1);
  for (int64_t r = r0; r < r1; ++r) {
    uint8_t* row = ybase + (r + pt) * owp * f;
    if (left)
      for (int64_t x = 0; x < pl; ++x) _mm512_mask_storeu_epi8(row + x * f, mask, fill);
    if (right)
      for (int64_t x = ow + pl; x < owp; ++x) _mm512_mask_storeu_epi8(row + x * f, mask, fill);
  }
  if (top)
    for (int64_t x = 0; x < pt * owp; ++x) _mm512_mask_storeu_epi8(ybase + x * f, mask, fill);
  if (bottom)
    for (int64_t x = (ohn + pt) * owp; x < (ohn + 2 * pt) * owp; ++x)
      _mm512_mask_storeu_epi8(ybase + x * f, mask, fill);
}

// The output's border next to the output pixels [p0, p1) of one image's 64-channel block at
// ybase: the left border of each row that starts among them, the right border of each that
// ends among them, the top rows with the first pixel and the bottom rows with the last.
static void fill_border(const int64_t* h, uint8_t* ybase, int64_t c0, int64_t p0, int64_t p1) {
  const int64_t ow = h[H_OW];
  for (int64_t r = p0 / ow; r <= (p1 - 1) / ow; ++r)     // output rows these pixels touch
    fill_edges(h, ybase, c0, r, r + 1, r * ow >= p0, r * ow + ow <= p1, 0, 0);
  fill_edges(h, ybase, c0, 0, 0, 0, 0, p0 == 0, p1 == h[H_OH] * ow);
}

// One chunk of H_CHUNK output pixels (flattened over OH x OW, so a tile of 6 may span rows) of
// image n for one 64-channel block; `terms` (matmuls only, else 0) holds the per-pixel terms
// [N][OH * OW] then the per-channel terms [N][FP], and each image n has its own packed weights
// (H_WSTRIDE bytes apart; 0 for convs, whose images share them).
static void conv_chunk(const uint8_t* xb, int64_t xo, const int8_t* wb, int64_t wo,
                       const int64_t* pb, int64_t po, const uint8_t* rb, int64_t ro,
                       const int32_t* terms, uint8_t* yb, int64_t yo, int64_t blk,
                       int64_t chunk, int64_t n) {
  const int64_t* h = pb + po;
  const int64_t hp = h[H_HP], wp = h[H_WP], c = h[H_C], kh = h[H_KH], kw = h[H_KW];
  const int64_t ow = h[H_OW], f = h[H_F], fp = h[H_FP], ohn = h[H_OH];
  conv_args a;
  // H_XSTEP (0: C): packed rows, a stem over the model input's few channels (C_in of them,
  // unpadded, H_XSTEP = C_in) as a conv of one column over C = KW * C_in bytes padded to 4:
  // 6 quads per kernel row of a 7x7 conv over RGB instead of 7, the bytes past the window
  // meeting zero weights
  a.xstep = h[H_XSTEP] ? h[H_XSTEP] : c;
  a.row = wp * a.xstep;
  a.c = c; a.kh = kh; a.kw = kw; a.sw = h[H_SW]; a.dh = h[H_DH]; a.dw = h[H_DW];
  // H_XOFF: the input's origin inside a bigger padded buffer (hp x wp), for a conv without
  // padding that reads another conv's padded output in place
  a.x = xb + xo + h[H_XOFF] + n * hp * a.row;
  const int64_t k = kh * kw * c;
  const int64_t c0 = blk * 64;
  int64_t nr16 = (fp - c0) / 16;
  const int nr = nr16 > 4 ? 4 : (int)nr16;
  a.w = wb + wo + n * h[H_WSTRIDE] + c0 * k;
  epi_args e;
  epi_init(h, &e);
  const int64_t esz = e.fout ? 4 : 1;     // bytes per output (and residual) element
  const int lean = lean_mode(&e);
  const int64_t pixels = ohn * ow;
  const int64_t p0 = chunk * h[H_CHUNK];
  const int64_t p1 = p0 + h[H_CHUNK] < pixels ? p0 + h[H_CHUNK] : pixels;
  const int64_t image = n * pixels;              // the image's first output pixel
  // the output may be the next conv's padded input: H_YPT rows and H_YPL columns of border on
  // each side, filled with H_YFILL (the next conv's zero point) by the chunks they touch
  const int64_t pt = h[H_YPT], pl = h[H_YPL], owp = ow + 2 * pl;
  uint8_t* ybase = yb + (yo + n * (ohn + 2 * pt) * owp * f + c0) * esz;
  // the residual may be read in place from a padded buffer too: H_RPT rows and H_RPL columns
  // of border on each side
  const int64_t rpt = h[H_RPT], rpl = h[H_RPL], owr = ow + 2 * rpl;
  // (without a residual the pointers are never read: formed from the output buffer instead)
  const uint8_t* rbase =
      (e.res ? rb + ro * esz : yb) + (n * (ohn + 2 * rpt) * owr * f + c0) * esz;
  if (pt || pl) fill_border(h, ybase, c0, p0, p1);
  terms_args tt;
  const terms_args* t = 0;
  if (terms) {
    tt.col = terms + h[H_N] * pixels + n * fp;
    t = &tt;
  }
  const int64_t sh_row = h[H_SH] * a.row, sw_c = a.sw * a.xstep;
  const int64_t oy = p0 / ow;             // the chunk's first output row
  int64_t ox = p0 % ow;                   // the next pixel's output column
  // The next pixel's window origin, output and residual (bytes from rbase): one pixel on, and
  // at a row's end the next row's start (the output's and residual's borders stepped over).
  const int64_t fe = f * esz;
  const uint8_t* xp = a.x + oy * sh_row + ox * sw_c;
  uint8_t* yp = ybase + ((oy + pt) * owp + ox + pl) * fe;
  int64_t roff = ((oy + rpt) * owr + ox + rpl) * fe;
  const int64_t xwrap = sh_row - ow * sw_c, ywrap = 2 * pl * fe, rwrap = 2 * rpl * fe;
  if (h[H_PAIR]) {
    // Pixel pairs (H_PAIR, tile): a pair's 2F outputs are one run of 2F elements where
    // its second pixel follows the first in the output (and residual); across a row's border,
    // or for a last pixel alone, the pair goes through a buffer. Pairs past the chunk's end
    // compute on the first input pixel into the buffer.
    const tile6_fn tp = TILE6P_FNS[nr >> 1][lean];
    for (int64_t p = p0; p < p1; p += 12) {
      const uint8_t* xs[6];
      const uint8_t* xt[6];
      uint8_t* ys[6];
      const uint8_t* rs[6];
      uint8_t* scatter[6][2];       // a buffered pair's pixels (0: none, or not buffered)
      _Alignas(64) uint8_t ybuf[6][256];
      _Alignas(64) uint8_t rbuf[6][256];
      for (int m = 0; m < 6; ++m) {
        const uint8_t* px[2] = {a.x, a.x};
        uint8_t* py[2] = {0, 0};
        const uint8_t* pr[2] = {rbase, rbase};
        for (int u = 0; u < 2 && p + 2 * m + u < p1; ++u) {
          px[u] = xp;
          py[u] = yp;
          pr[u] = rbase + roff;
          xp += sw_c;
          yp += fe;
          roff += fe;
          if (++ox == ow) { ox = 0; xp += xwrap; yp += ywrap; roff += rwrap; }
        }
        xs[m] = px[0];
        xt[m] = px[1];
        scatter[m][0] = scatter[m][1] = 0;
        if (py[1] && py[1] == py[0] + fe && (!e.res || pr[1] == pr[0] + fe)) {
          ys[m] = py[0];
          rs[m] = pr[0];
          continue;
        }
        ys[m] = ybuf[m];
        scatter[m][0] = py[0];
        scatter[m][1] = py[1];
        rs[m] = rbuf[m];
        if (e.res) {
          if (py[0]) copy_bytes(rbuf[m], pr[0], fe);
          if (py[1]) copy_bytes(rbuf[m] + fe, pr[1], fe);
        }
      }
      tp(&a, &e, 0, xs, xt, c0, 2 * f, e.res ? rs : 0, ys);
      for (int m = 0; m < 6; ++m)
        for (int u = 0; u < 2; ++u)
          if (scatter[m][u]) copy_bytes(scatter[m][u], ybuf[m] + u * fe, fe);
    }
    return;
  }
  tile6_fn tile6 = TILE6_FNS[nr - 1][lean];
  // 3 kernel rows of 3 quads that lie one after another (STEM3: a 3x3 conv over C <= 4
  // channels, or packed rows of 12 bytes): the unrolled tile for its common forms
  if (kh == 3 && kw * c == 12 && h[H_DH] == 1 && a.dw == 1 && (kw == 1 || a.xstep == c) &&
      lean == LEAN && !terms && (nr == 2 || nr == 4) && f - c0 > 16 * (nr - 1))
    tile6 = nr == 2 ? tile6s_2_1 : tile6s_4_1;
  for (int64_t p = p0; p < p1; p += 6) {
    int mr = p1 - p >= 6 ? 6 : (int)(p1 - p);
    const uint8_t* xs[6];
    uint8_t* ys[6];
    const uint8_t* rs[6];
#pragma GCC unroll 6
    for (int m = 0; m < 6; ++m) {
      if (m < mr) {
        xs[m] = xp;
        ys[m] = yp;
        xp += sw_c;
        yp += fe;
        if (e.res) {
          rs[m] = rbase + roff;
          roff += fe;
        }
        if (++ox == ow) { ox = 0; xp += xwrap; yp += ywrap; roff += rwrap; }
      } else {
        xs[m] = a.x;
        ys[m] = ybase;
        rs[m] = rbase;
      }
    }
    const uint8_t* const* rp = e.res ? rs : 0;
    if (terms) tt.row = terms + image + p;
    if (mr == 6) {
      tile6(&a, &e, t, xs, 0, c0, f, rp, ys);
      continue;
    }
    switch (nr) {
      case 1: tiles_1(&a, &e, t, xs, c0, f, rp, ys, mr, lean); break;
      case 2: tiles_2(&a, &e, t, xs, c0, f, rp, ys, mr, lean); break;
      case 3: tiles_3(&a, &e, t, xs, c0, f, rp, ys, mr, lean); break;
      default: tiles_4(&a, &e, t, xs, c0, f, rp, ys, mr, lean); break;
    }
  }
}

void qk_conv2d_u8s8(const uint8_t* xb, int64_t xo, const int8_t* wb, int64_t wo,
                    const int64_t* pb, int64_t po, const uint8_t* rb, int64_t ro,
                    uint8_t* yb, int64_t yo, int64_t blk, int64_t chunk, int64_t n) {
  conv_chunk(xb, xo, wb, wo, pb, po, rb, ro, 0, yb, yo, blk, chunk, n);
}

// ---- Winograd F(4x4, 3x3): qk_wino_u8s8 -----------------------------------------------------
//
// A 3x3 stride-1 conv as F(4x4, 3x3) (Lavin & Gray) in exact integer arithmetic: per 4x4 tile
// of output pixels, the 6x6 input patch (centered: u8 - 128, i16) goes through
// V = Bᵀ d B (|V| <= 100 * 128), the weights were packed as U = Gs g Gsᵀ (i16, |U| <= 49 * 127;
// Gs = D G with D = diag(4, 6, 6, 24, 24, 1) makes G integral), the 36 products U ⊙ V are summed
// over the input channels by vpdpwssd (i32, wrapping), and Z = Asᵀ M As (As = 24 D⁻¹ A, integral)
// equals 576 Y modulo 2^32, Y the tile's exact sum of (x - 128) w. Since 576 = 64 * 9 and every
// step is a ring operation, Z * 9⁻¹ == 64 Y (mod 2^32), which is 64 Y itself (in i32, so Y is
// its arithmetic shift by 6) wherever |Y| < 2^25, which wino_fits (ukernel/__init__.py) checks
// from the weights (128 * sum |w| < 2^25 per output channel). Adding 128 * sum w gives the direct
// kernel's accumulator bit for bit; the requantize epilogue is the direct kernel's (FROMBUF).
// Patch rows or columns past the padded input (the last tiles of an image whose OH or OW is no
// multiple of 4) read the last row or column instead: they only reach outputs past OH x OW,
// which are not stored.
//
// The weights: per block [36][C/2][64][2] i16, then 128 * sum w (i32, FP).
// C (padded) a multiple of 32, F a multiple of 64.
enum { WMR = 6, WCH = 32 };       // tiles per group (the GEMM's rows), channels per transform

// 1-D transform Bᵀ d of six i16 vectors
INLINE void wino_bt(const __m512i d[6], __m512i t[6]) {
  const __m512i a = _mm512_sub_epi16(d[4], d[2]);                          // d4 - d2
  const __m512i b = _mm512_sub_epi16(d[3], d[1]);                          // d3 - d1
  t[0] = _mm512_add_epi16(_mm512_slli_epi16(_mm512_sub_epi16(d[0], d[2]), 2), a);
  t[1] = _mm512_sub_epi16(_mm512_add_epi16(d[3], d[4]),
                          _mm512_slli_epi16(_mm512_add_epi16(d[1], d[2]), 2));
  t[2] = _mm512_add_epi16(_mm512_sub_epi16(d[4], d[3]),
                          _mm512_slli_epi16(_mm512_sub_epi16(d[1], d[2]), 2));
  t[3] = _mm512_add_epi16(a, _mm512_slli_epi16(b, 1));
  t[4] = _mm512_sub_epi16(a, _mm512_slli_epi16(b, 1));
  t[5] = _mm512_add_epi16(_mm512_sub_epi16(_mm512_slli_epi16(d[1], 2), _mm512_slli_epi16(d[3], 2)),
                          _mm512_sub_epi16(d[5], d[3]));
}

// 1-D transform Asᵀ m of six i32 vectors into four (rows 6 4 4 1 1 0 / 0 4 -4 2 -2 0 /
// 0 4 4 4 4 0 / 0 4 -4 8 -8 24)
INLINE void wino_at(const __m512i m[6], __m512i z[4]) {
  const __m512i s12 = _mm512_add_epi32(m[1], m[2]), d12 = _mm512_sub_epi32(m[1], m[2]);
  const __m512i s34 = _mm512_add_epi32(m[3], m[4]), d34 = _mm512_sub_epi32(m[3], m[4]);
  const __m512i m0 = _mm512_add_epi32(_mm512_slli_epi32(m[0], 1), m[0]);      // 3 m0
  z[0] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(m0, _mm512_slli_epi32(s12, 1)), 1),
                          s34);                                                // 6m0 + 4s12 + s34
  z[1] = _mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(d12, 1), d34), 1);
  z[2] = _mm512_slli_epi32(_mm512_add_epi32(s12, s34), 2);
  const __m512i m5 = _mm512_add_epi32(_mm512_slli_epi32(m[5], 1), m[5]);      // 3 m5
  z[3] = _mm512_slli_epi32(_mm512_add_epi32(_mm512_add_epi32(d12, _mm512_slli_epi32(d34, 1)),
                                            _mm512_slli_epi32(m5, 1)), 2);    // 4d12+8d34+24m5
}

// The transformed input of mr tiles, channels cc .. cc + 31, as v[pos][m][32] i16: tile m's
// patch row i at x + roff[6 m + i], column j at coff[6 m + j]
INLINE void wino_input(const uint8_t* x, const int64_t* roff, const int64_t* coff, int mr,
                       int64_t cc, int16_t* v) {
  const __m512i bias = _mm512_set1_epi16(128);
  for (int m = 0; m < mr; ++m) {
    __m512i r[6][6];
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) {
      const uint8_t* xr = x + roff[6 * m + i] + cc;
      __m512i d[6];
#pragma GCC unroll 6
      for (int j = 0; j < 6; ++j)
        d[j] = _mm512_sub_epi16(
            _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(xr + coff[6 * m + j]))),
            bias);
      wino_bt(d, r[i]);
    }
#pragma GCC unroll 6
    for (int k = 0; k < 6; ++k) {
      __m512i d[6], t[6];
#pragma GCC unroll 6
      for (int i = 0; i < 6; ++i) d[i] = r[i][k];
      wino_bt(d, t);
#pragma GCC unroll 6
      for (int a = 0; a < 6; ++a)
        _mm512_storeu_si512((void*)(v + ((a * 6 + k) * WMR + m) * WCH), t[a]);
    }
  }
}

// acc[pos][m][64] (+)= v[pos][m][32] · u[pos][32 channels][64] for the 36 positions
INLINE void wino_gemm(const int16_t* v, const int16_t* u, int64_t pairs, int32_t* acc,
                      const int first, const int MR) {
  for (int pos = 0; pos < 36; ++pos) {
    __m512i s[WMR][4];
    int32_t* ap = acc + pos * WMR * 64;
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        s[m][j] = first ? _mm512_setzero_si512()
                        : _mm512_loadu_si512((const void*)(ap + m * 64 + 16 * j));
    const int16_t* vp = v + pos * WMR * WCH;
    const int16_t* up = u + pos * pairs * 128;
    // the next position's weights (after the last, the next channels' first; past the block's
    // end after its last, which a prefetch may touch) into L2: each position's 4 KB lies apart
    // from the last (a stride of C / 2 * 256 bytes), where the hardware's stream prefetch
    // starts over (resnet18 batch 1 4.13 -> 4.08 ms; 14x14x256 alone 0.434 -> 0.415)
    const int16_t* un = pos < 35 ? up + pairs * 128 : u + WCH / 2 * 128;
#pragma GCC unroll 2
    for (int q = 0; q < WCH / 2; ++q) {
      __m512i w[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) w[j] = _mm512_loadu_si512((const void*)(up + q * 128 + 32 * j));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(un + q * 128 + 32 * j), _MM_HINT_T1);
#pragma GCC unroll 6
      for (int m = 0; m < MR; ++m) {
        const __m512i x = _mm512_set1_epi32(*(const int32_t*)(vp + m * WCH + 2 * q));
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) s[m][j] = _mm512_dpwssd_epi32(s[m][j], x, w[j]);
      }
      // (each accumulator in a register: without this gcc 12 copies them between registers
      // and the stack on every step, as in tile())
#pragma GCC unroll 6
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) __asm__("" : "+v"(s[m][j]));
    }
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) _mm512_storeu_si512((void*)(ap + m * 64 + 16 * j), s[m][j]);
  }
}

#define WINO_GEMM(MR, FIRST)                                                                 \
  static __attribute__((noinline)) void wino_gemm_##MR##_##FIRST(                           \
      const int16_t* v, const int16_t* u, int64_t pairs, int32_t* acc) {                     \
    wino_gemm(v, u, pairs, acc, FIRST, MR);                                                  \
  }
#define WINO_GEMMS(MR) WINO_GEMM(MR, 0) WINO_GEMM(MR, 1)
WINO_GEMMS(1) WINO_GEMMS(2) WINO_GEMMS(3) WINO_GEMMS(4) WINO_GEMMS(5) WINO_GEMMS(6)
typedef void (*wino_gemm_fn)(const int16_t*, const int16_t*, int64_t, int32_t*);
static const wino_gemm_fn WINO_GEMM_FNS[WMR][2] = {
    {wino_gemm_1_0, wino_gemm_1_1}, {wino_gemm_2_0, wino_gemm_2_1},
    {wino_gemm_3_0, wino_gemm_3_1}, {wino_gemm_4_0, wino_gemm_4_1},
    {wino_gemm_5_0, wino_gemm_5_1}, {wino_gemm_6_0, wino_gemm_6_1}};

// The sums of mr tiles (acc) back to pixels: ypix[row][4 m + col][64] i32, the direct kernel's
// accumulators (Y plus 128 * sum w, plus the narrow epilogue's bias: corr, the block's 64
// channels); Y = (Z * 9⁻¹) >> 6, see above.
static void wino_output(const int32_t* acc, int mr, const int32_t* corr, int32_t* ypix) {
  const __m512i inv9 = _mm512_set1_epi32((int32_t)954437177);      // 9 * inv9 == 1 mod 2^32
  for (int m = 0; m < mr; ++m)
#pragma GCC unroll 1
    for (int j = 0; j < 4; ++j) {
      __m512i t[4][6];
#pragma GCC unroll 6
      for (int k = 0; k < 6; ++k) {
        __m512i col[6], z[4];
#pragma GCC unroll 6
        for (int a = 0; a < 6; ++a)
          col[a] = _mm512_loadu_si512((const void*)(acc + ((a * 6 + k) * WMR + m) * 64 + 16 * j));
        wino_at(col, z);
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) t[p][k] = z[p];
      }
      const __m512i c = _mm512_loadu_si512((const void*)(corr + 16 * j));
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        __m512i z[4];
        wino_at(t[p], z);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const __m512i y = _mm512_srai_epi32(_mm512_mullo_epi32(z[q], inv9), 6);
          _mm512_storeu_si512((void*)(ypix + (p * 4 * WMR + 4 * m + q) * 64 + 16 * j),
                              _mm512_add_epi32(y, c));
        }
      }
    }
}

// One call: H_CHUNK tiles of 4x4 output pixels (flattened over the images, their bands of 4
// rows and the tiles across a band, so that a chunk, and a group, may span bands and images),
// one block of 64 output channels, in groups of up to WMR tiles. The grid is (blocks, chunks,
// 1): in a batch, a group of tiles from two images shares one pass over the block's weights.
void qk_wino_u8s8(const uint8_t* xb, int64_t xo, const int8_t* wb, int64_t wo,
                  const int64_t* pb, int64_t po, const uint8_t* rb, int64_t ro, uint8_t* yb,
                  int64_t yo, int64_t blk, int64_t chunk, int64_t n) {
  const int64_t* h = pb + po;
  const int64_t hp = h[H_HP], wp = h[H_WP], c = h[H_C], ow = h[H_OW], f = h[H_F];
  const int64_t ohn = h[H_OH];
  const int64_t c0 = blk * 64;
  epi_args e;
  epi_init(h, &e);
  const int lean = lean_mode(&e);
  const tile6_fn tile6 = TILE6B_FNS[lean];
  const int64_t row = wp * c;
  const uint8_t* x = xb + xo;
  const int16_t* u = (const int16_t*)(wb + wo) + blk * 36 * c * 64;
  const int32_t* wcorr =
      (const int32_t*)((const int16_t*)(wb + wo) + h[H_FP] / 64 * 36 * c * 64) + c0;
  _Alignas(64) int32_t corr[64];      // 128 * sum w, plus the narrow epilogue's bias
  for (int j = 0; j < 64; ++j) corr[j] = wcorr[j] + (e.narrow ? e.bias32[c0 + j] : 0);
  const int64_t pt = h[H_YPT], pl = h[H_YPL], owp = ow + 2 * pl;
  const int64_t rpt = h[H_RPT], rpl = h[H_RPL], owr = ow + 2 * rpl;
  // the tiles of all N images, flattened: image i's bands are bands i * bh .. i * bh + bh - 1
  (void)n;          // (the grid's third dimension is 1)
  const int64_t bh = (ohn + 3) / 4, tw = (ow + 3) / 4, tiles = h[H_N] * bh * tw;
  const int64_t ximg = hp * row;                          // bytes per image: input, output,
  const int64_t yimg = (ohn + 2 * pt) * owp * f, rimg = (ohn + 2 * rpt) * owr * f;   // residual
  uint8_t* ybase = yb + yo + c0;                          // (image 0's)
  const uint8_t* rbase = (e.res ? rb + ro : yb) + c0;
  const int64_t q0 = chunk * h[H_CHUNK];
  const int64_t q1 = q0 + h[H_CHUNK] < tiles ? q0 + h[H_CHUNK] : tiles;
  if (pt || pl)
    for (int64_t gb = q0 / tw; gb <= (q1 - 1) / tw; ++gb) {   // the bands these tiles touch
      const int64_t b = gb % bh, first = gb * tw >= q0, last = gb * tw + tw <= q1;
      fill_edges(h, ybase + gb / bh * yimg, c0, 4 * b, 4 * b + 4 < ohn ? 4 * b + 4 : ohn,
                 first, last, b == 0 && first, b == bh - 1 && last);
    }
  _Alignas(64) int16_t v[36 * WMR * WCH];
  _Alignas(64) int32_t acc[36 * WMR * 64];
  _Alignas(64) int32_t ypix[4 * 4 * WMR * 64];
  const int64_t groups = (q1 - q0 + WMR - 1) / WMR;
  for (int64_t g = 0, t0 = q0; g < groups; ++g) {
    const int mr = (int)((q1 - t0 + (groups - g) - 1) / (groups - g));   // balanced groups
    int64_t roff[6 * WMR], coff[6 * WMR];
    for (int m = 0; m < mr; ++m)
      for (int j = 0; j < 6; ++j) {
        // (patch rows and columns past the padded input read its last: see above)
        const int64_t gb = (t0 + m) / tw;
        const int64_t ry = 4 * (gb % bh) + j, cx = 4 * ((t0 + m) % tw) + j;
        roff[6 * m + j] = gb / bh * ximg + (ry < hp ? ry : hp - 1) * row;
        coff[6 * m + j] = (cx < wp ? cx : wp - 1) * c;
      }
    for (int64_t cc = 0; cc < c; cc += WCH) {
      wino_input(x, roff, coff, mr, cc, v);
      WINO_GEMM_FNS[mr - 1][cc == 0](v, u + cc * 64, c / 2, acc);
    }
    wino_output(acc, mr, corr, ypix);
    // the epilogue: each run of the group's tiles in one band, row by row, six pixels at a time
    for (int m0 = 0; m0 < mr;) {
      const int64_t gb = (t0 + m0) / tw, band = gb % bh;
      int m1 = m0 + 1;
      while (m1 < mr && (t0 + m1) / tw == gb) ++m1;
      const int64_t x0 = 4 * ((t0 + m0) % tw);
      const int64_t x1 = x0 + 4 * (m1 - m0) < ow ? x0 + 4 * (m1 - m0) : ow;
      uint8_t* yi = ybase + gb / bh * yimg;
      const uint8_t* ri = rbase + gb / bh * rimg;
      for (int p = 0; p < 4 && 4 * band + p < ohn; ++p) {
        const int64_t r = 4 * band + p;
        for (int64_t xx = x0; xx < x1; xx += 6) {
          const int k = x1 - xx >= 6 ? 6 : (int)(x1 - xx);
          const uint8_t* xs[6];
          uint8_t* ys[6];
          const uint8_t* rs[6];
          for (int m = 0; m < 6; ++m) {
            const int64_t px = xx + (m < k ? m : 0);
            xs[m] = (const uint8_t*)(ypix + (p * 4 * WMR + 4 * m0 + px - x0) * 64);
            ys[m] = yi + ((r + pt) * owp + px + pl) * f;
            rs[m] = ri + ((r + rpt) * owr + px + rpl) * f;
          }
          const uint8_t* const* rp = e.res ? rs : 0;
          if (k == 6)
            tile6(0, &e, 0, xs, 0, c0, f, rp, ys);
          else
            tiles_b4(0, &e, 0, xs, c0, f, rp, ys, k, lean);
        }
      }
      m0 = m1;
    }
    t0 += mr;
  }
}

// A batch of GEMMs x[n] (u8, [M, K]) times w[n] (s8, packed per image) with the zero-point terms
// of both run-time operands (`terms`, i32) and the requantize.
void qk_matmul_u8s8(const uint8_t* xb, int64_t xo, const int8_t* wb, int64_t wo,
                    const int64_t* pb, int64_t po, const int32_t* tb, int64_t to,
                    uint8_t* yb, int64_t yo, int64_t blk, int64_t chunk, int64_t n) {
  conv_chunk(xb, xo, wb, wo, pb, po, 0, 0, tb + to, yb, yo, blk, chunk, n);
}

// The model input's quantize, written as a microkernel conv's padded input: f32 NCHW with
// C <= 4 channels in, u8 NHWC with 4 channels out, bordered by PT rows and PL columns on each
// side. q = clamp(roundeven(x * inv) + zp, qmin, qmax) in f32, like qmath.quantize_array; the
// border and the channels past C hold the fill (the conv's zero point). One call writes
// Q_ROWS input rows of image n (and the border rows next to them). Q_PACKED: C bytes per pixel
// instead of 4 (the packed rows of a stem, H_XSTEP), which needs AVX-512 VBMI.
enum { Q_N, Q_C, Q_H, Q_W, Q_PT, Q_PL, Q_ZP, Q_QMIN, Q_QMAX, Q_INV, Q_FILL, Q_ROWS, Q_PACKED };
#define Q_MAX_W 2048   // the widest input row the packed form takes (pixels; a stack row)

// (returns the lanes that held a NaN or an infinity: the caller's input check)
static __mmask16 quantize_row(const float* x, int64_t plane, int64_t w, int64_t c, __m512 inv,
                              __m512 zp, __m512 lo, __m512 hi, __m512i fill, uint32_t* y) {
  __mmask16 bad = 0;
  for (int64_t i = 0; i < w; i += 16) {
    const __mmask16 m = live16(w - i);
    __m512i px = fill;
    for (int64_t ch = 0; ch < c; ++ch) {
      __m512 v = _mm512_maskz_loadu_ps(m, x + ch * plane + i);
      bad |= _mm512_fpclass_ps_mask(v, 0x99);      // QNaN, +inf, -inf, SNaN
      v = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, zp), lo), hi);
      const __m512i q = _mm512_cvttps_epi32(v);
      const __m512i keep = _mm512_set1_epi32(~(0xFF << (8 * ch)));
      px = _mm512_or_si512(_mm512_and_si512(px, keep), _mm512_slli_epi32(q, (unsigned)(8 * ch)));
    }
    _mm512_mask_storeu_epi32((void*)(y + i), m, px);
  }
  return bad;
}

// pack_row's vpermb indices for c bytes per pixel: the byte (p, ch) from byte 4 p + ch
static __m512i pack_perm(int64_t c) {
  uint8_t idx[64];
  for (int j = 0; j < 64; ++j) idx[j] = (uint8_t)(j < 16 * c ? 4 * (j / c) + j % c : 0);
  return _mm512_loadu_si512((const void*)idx);
}

// A row of w pixels of 4 bytes (quantize_row's) written as c bytes per pixel: 16 pixels per
// vpermb (perm: pack_perm(c))
__attribute__((target("avx512vbmi"))) static void pack_row(const uint32_t* px, int64_t w,
                                                           int64_t c, __m512i perm,
                                                           uint8_t* y) {
  for (int64_t i = 0; i < w; i += 16) {
    const int64_t n = (w - i < 16 ? w - i : 16) * c;
    const __m512i v = _mm512_maskz_loadu_epi32(live16(w - i), (const void*)(px + i));
    _mm512_mask_storeu_epi8((void*)(y + i * c), n >= 64 ? ~(__mmask64)0
                            : (((__mmask64)1 << n) - 1), _mm512_permutexvar_epi8(perm, v));
  }
}

// One chunk of the quantize; a NaN or infinity among its inputs sets *nonfinite (when given):
// the input check of the caller, made while the values pass through here anyway.
static void quantize_chunk(const float* xb, int64_t xo, const int64_t* pb, int64_t po,
                           uint8_t* yb, int64_t yo, int64_t chunk, int64_t n,
                           int64_t* nonfinite) {
  const int64_t* h = pb + po;
  const int64_t c = h[Q_C], hh = h[Q_H], w = h[Q_W], pt = h[Q_PT], pl = h[Q_PL];
  const int64_t wp = w + 2 * pl, hp = hh + 2 * pt;
  const int32_t invbits = (int32_t)h[Q_INV];
  float inv;
  __builtin_memcpy(&inv, &invbits, sizeof inv);
  const __m512 vinv = _mm512_set1_ps(inv), zp = _mm512_set1_ps((float)h[Q_ZP]);
  const __m512 lo = _mm512_set1_ps((float)h[Q_QMIN]), hi = _mm512_set1_ps((float)h[Q_QMAX]);
  const uint32_t f8 = (uint32_t)h[Q_FILL] & 0xFFu;
  const uint32_t fill = f8 * 0x01010101u;
  const __m512i vfill = _mm512_set1_epi32((int32_t)fill);
  const float* x = xb + xo + n * c * hh * w;
  const int64_t r0 = chunk * h[Q_ROWS];
  const int64_t r1 = r0 + h[Q_ROWS] < hh ? r0 + h[Q_ROWS] : hh;
  // border rows: the top ones with the first chunk, the bottom ones with the last
  const int64_t b0 = r0 == 0 ? 0 : r0 + pt, b1 = r1 == hh ? hp : r1 + pt;
  __mmask16 bad = 0;
  if (h[Q_PACKED]) {
    uint8_t* y8 = yb + yo + n * hp * wp * c;
    uint32_t px[Q_MAX_W];
    const __m512i perm = pack_perm(c);
    for (int64_t r = b0; r < b1; ++r) {
      uint8_t* row = y8 + r * wp * c;
      if (r < pt || r >= hh + pt) {
        for (int64_t i = 0; i < wp * c; ++i) row[i] = (uint8_t)f8;
        continue;
      }
      for (int64_t i = 0; i < pl * c; ++i) row[i] = row[(pl + w) * c + i] = (uint8_t)f8;
      bad |= quantize_row(x + (r - pt) * w, hh * w, w, c, vinv, zp, lo, hi, vfill, px);
      pack_row(px, w, c, perm, row + pl * c);
    }
    if (bad && nonfinite) __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
    return;
  }
  uint32_t* y = (uint32_t*)(yb + yo) + n * hp * wp;
  for (int64_t r = b0; r < b1; ++r) {
    uint32_t* row = y + r * wp;
    if (r < pt || r >= hh + pt) {
      for (int64_t i = 0; i < wp; ++i) row[i] = fill;
      continue;
    }
    for (int64_t i = 0; i < pl; ++i) row[i] = row[pl + w + i] = fill;
    bad |= quantize_row(x + (r - pt) * w, hh * w, w, c, vinv, zp, lo, hi, vfill, row + pl);
  }
  if (bad && nonfinite) __atomic_store_n(nonfinite, 1, __ATOMIC_RELAXED);
}

void qk_quantize_nchw(const float* xb, int64_t xo, const int64_t* pb, int64_t po, uint8_t* yb,
                      int64_t yo, int64_t chunk, int64_t unused, int64_t n) {
  (void)unused;
  quantize_chunk(xb, xo, pb, po, yb, yo, chunk, n, 0);
}

// Several linears that read the same input (attention's q, k and v projections) as one
// dispatch: the grid's channel blocks run over the linears one after another. params starts
// with a directory, M_SEGS then per linear (first block, its params' offset in i64, its packed
// weights' offset in bytes, its output's offset in bytes), each linear's params (pack_params)
// after it; the outputs lie back to back.
enum { M_SEGS = 0, M_DIR = 1, M_ENTRY = 4 };

void qk_linear_multi(const uint8_t* xb, int64_t xo, const int8_t* wb, int64_t wo,
                     const int64_t* pb, int64_t po, uint8_t* yb, int64_t yo, int64_t blk,
                     int64_t chunk, int64_t n) {
  const int64_t* d = pb + po;
  int64_t i = d[M_SEGS] - 1;
  while (i > 0 && blk < d[M_DIR + i * M_ENTRY]) --i;
  const int64_t* s = d + M_DIR + i * M_ENTRY;
  conv_chunk(xb, xo, wb, wo + s[2], pb, po + s[1], 0, 0, 0, yb, yo + s[3], blk - s[0], chunk, n);
}

// Fused int8 attention of one head: S = Q·Kᵀ (i32) → requantize → mask table → int8 softmax →
// P·V (i32) → requantize, each step exactly as qcompile's reference (qmath.requantize, the
// MASK_LUT table, qmath.softmax_codes). q, k, v are [N, S, H·D] rows (a head's D columns start
// at head·D), the mask [N or 1, S] (i64, clamped to -1..2 to pick a table row), the output
// [N, S, H·D] like q: the head split and merge permutes are only addressing here. One call
// computes A_ROWS query rows of one head of image n; the head's K and V are packed on the stack
// (K as [S/16][D/4][16][4] s8, V as [S/4][D][4] s8) with their column sums.
//   scores: sum (q - zq)(k - zk) = sum q·k' - zk'·sum q - zq·sum k' + D zq zk'  (k' = k - 128)
//   P·V:    sum (p - zp)(v - zv) = sum p·v' - zv'·sum p - zp·sum v' + S zp zv'
// The softmax's quotient floor((2 e M + t 2^16) / (t 2^17)) is a float64 product with the
// reciprocal, corrected by one remainder test; every float64 step there is exact (integers
// below 2^53; the remainder by a fused multiply-subtract).
enum {
  A_S, A_H, A_D, A_LDQ, A_LDK, A_LDV, A_LDO, A_ROWS, A_QFLIP, A_KFLIP, A_VFLIP,
  A_ZQ, A_ZK, A_ZV, A_ZP, A_MASK, A_MASKN, A_CLO,
  A_B1, A_M1, A_S1, A_Z1, A_LO1, A_HI1,
  A_SM, A_SZ, A_SLO, A_SHI,
  A_B2, A_M2, A_S2, A_Z2, A_LO2, A_HI2,
  A_NARROW1, A_NARROW2, A_VBMI, A_SIGNED1,
  A_HEADER = 40
};
#define A_MAXS 512
#define A_MAXSD 16384

INLINE __m512i rq8_scalar(__m512i v, const int64_t* p) {   // p: bias, m, shift, zp, lo, hi
  __m512i t = _mm512_mullo_epi64(_mm512_add_epi64(v, _mm512_set1_epi64(p[0])),
                                 _mm512_set1_epi64(p[1]));
  t = _mm512_add_epi64(t, _mm512_set1_epi64((int64_t)1 << (p[2] - 1)));
  t = _mm512_sra_epi64(t, _mm_cvtsi64_si128(p[2]));
  t = _mm512_add_epi64(t, _mm512_set1_epi64(p[3]));
  t = _mm512_max_epi64(t, _mm512_set1_epi64(p[4]));
  return _mm512_min_epi64(t, _mm512_set1_epi64(p[5]));
}

// qmath.requantize of 16 i32 accumulators with one (per-tensor) term: i32 codes. `narrow`
// (pack_attention_params: every acc + bias fits in i32, m < 2^31, shift >= 33): the products
// by vpmuldq and only their high halves on, as store16_narrow does.
INLINE __m512i rq16_scalar(__m512i acc, const int64_t* p, int narrow) {
  if (narrow) {
    const __m512i v = _mm512_add_epi32(acc, _mm512_set1_epi32((int32_t)p[0]));
    const __m512i m = _mm512_set1_epi64(p[1]);
    __m512i pe = _mm512_mul_epi32(v, m);
    __m512i po = _mm512_mul_epi32(_mm512_srli_epi64(v, 32), m);
    __m512i t = high32(pe, po);
    t = _mm512_add_epi32(t, _mm512_set1_epi32((int32_t)1 << (p[2] - 33)));
    t = _mm512_sra_epi32(t, _mm_cvtsi64_si128(p[2] - 32));
    t = _mm512_add_epi32(t, _mm512_set1_epi32((int32_t)p[3]));
    t = _mm512_max_epi32(t, _mm512_set1_epi32((int32_t)p[4]));
    return _mm512_min_epi32(t, _mm512_set1_epi32((int32_t)p[5]));
  }
  __m512i lo = rq8_scalar(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc)), p);
  __m512i hi = rq8_scalar(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1)), p);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(lo)),
                            _mm512_cvtepi64_epi32(hi), 1);
}

// 8 softmax codes from table entries e (i32): zp + floor((2 e M + base) / den), clamped
INLINE __m256i softmax8(__m256i e, __m512d m2, __m512d base, __m512d den, __m512d inv,
                        __m512d zp, __m512d lo, __m512d hi) {
  const __m512d num = _mm512_fmadd_pd(_mm512_cvtepi32_pd(e), m2, base);     // exact
  __m512d q = _mm512_roundscale_pd(_mm512_mul_pd(num, inv),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512d r = _mm512_fmsub_pd(q, den, num);        // q·den - num, exact
  const __m512d one = _mm512_set1_pd(1.0), zero = _mm512_setzero_pd();
  q = _mm512_mask_sub_pd(q, _mm512_cmp_pd_mask(r, zero, _CMP_GT_OQ), q, one);
  q = _mm512_mask_add_pd(q, _mm512_cmp_pd_mask(_mm512_add_pd(r, den), zero, _CMP_LE_OQ), q,
                         one);
  q = _mm512_min_pd(_mm512_max_pd(_mm512_add_pd(q, zp), lo), hi);
  return _mm512_cvtpd_epi32(q);
}

// The mask lookups and the softmax's exp entries of one row of scores (`row`: the i32 codes
// the first requantize gives, keys past S ignored): row[j] becomes e_j, and the sum of e
// is returned. Two forms with the same result: vpgatherdd from the i32 tables, and (hosts
// with AVX-512 VBMI, A_VBMI) 256-entry byte tables by two vpermt2b and a blend on the index's
// top bit, 64 keys at a time, the 22-bit exp entries as three byte planes.
static int64_t row_exp_gather(int32_t* row, const int32_t* offs, const int32_t* mtab,
                              const int32_t* etab, int64_t s, int64_t sp) {
  __m512i vmax = _mm512_set1_epi32(INT32_MIN);
  for (int64_t jb = 0; jb < sp; jb += 16) {
    __m512i c = _mm512_i32gather_epi32(_mm512_add_epi32(
        _mm512_load_si512((const void*)(row + jb)), _mm512_load_si512((const void*)(offs + jb))),
        (const void*)mtab, 4);
    _mm512_store_si512((void*)(row + jb), c);
    vmax = _mm512_mask_max_epi32(vmax, live16(s - jb), vmax, c);
  }
  const __m512i mx = _mm512_set1_epi32(_mm512_reduce_max_epi32(vmax));
  __m512i tot = _mm512_setzero_si512();      // at most S/16 entries of 2^22 per lane
  for (int64_t jb = 0; jb < sp; jb += 16) {
    __m512i dist = _mm512_sub_epi32(mx, _mm512_load_si512((const void*)(row + jb)));
    __m512i e = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live16(s - jb), dist,
                                            (const void*)etab, 4);
    _mm512_store_si512((void*)(row + jb), e);
    tot = _mm512_add_epi32(tot, e);
  }
  return _mm512_reduce_add_epi32(tot);
}

__attribute__((target("avx512vbmi"))) static inline __m512i lut256(__m512i idx,
                                                                     const uint8_t* t) {
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512((const void*)t), idx,
                                              _mm512_loadu_si512((const void*)(t + 64)));
  const __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512((const void*)(t + 128)), idx,
                                              _mm512_loadu_si512((const void*)(t + 192)));
  return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi);
}

// bytes: the mask tables [4][256] (codes), the exp table's three planes [3][256]; rowid[j] the
// key's mask-table row (2 past S: those keys are masked out of the max and the sum); `lo`
// the scores' dtype low end
__attribute__((target("avx512vbmi"))) static int64_t row_exp_vbmi(
    int32_t* row, const uint8_t* rowid, const uint8_t* tables, int64_t lo, int is_signed,
    int64_t s, int64_t sp) {
  uint8_t codes[A_MAXS] __attribute__((aligned(64)));
  const int64_t s64 = (sp + 63) & ~(int64_t)63;
  __m512i vmax = _mm512_set1_epi8(is_signed ? (char)-128 : 0);
  const __m512i vlo = _mm512_set1_epi32((int32_t)lo);
  for (int64_t j = 0; j < s64; j += 64) {
    __m512i idx = _mm512_setzero_si512();
    for (int u = 0; u < 4 && j + 16 * u < sp; ++u) {
      const __m128i b = _mm512_cvtepi32_epi8(_mm512_sub_epi32(
          _mm512_load_si512((const void*)(row + j + 16 * u)), vlo));
      idx = _mm512_inserti32x4(idx, b, u);     // (lane u in the 4 × 128-bit lanes)
    }
    const __m512i rid = _mm512_load_si512((const void*)(rowid + j));
    __m512i c = _mm512_setzero_si512();
    for (int r = 0; r < 4; ++r) {
      const __mmask64 m = _mm512_cmpeq_epi8_mask(rid, _mm512_set1_epi8((char)r));
      if (m) c = _mm512_mask_mov_epi8(c, m, lut256(idx, tables + 256 * r));
    }
    _mm512_store_si512((void*)(codes + j), c);
    const int64_t left = s - j;
    const __mmask64 live = left >= 64 ? ~(__mmask64)0 : left <= 0 ? 0
                           : (((__mmask64)1 << left) - 1);
    vmax = is_signed ? _mm512_mask_max_epi8(vmax, live, vmax, c)
                     : _mm512_mask_max_epu8(vmax, live, vmax, c);
  }
  // the row max: reduce the 64 bytes
  __m256i m256 = is_signed ? _mm256_max_epi8(_mm512_castsi512_si256(vmax),
                                             _mm512_extracti64x4_epi64(vmax, 1))
                           : _mm256_max_epu8(_mm512_castsi512_si256(vmax),
                                             _mm512_extracti64x4_epi64(vmax, 1));
  __m128i m128 = is_signed ? _mm_max_epi8(_mm256_castsi256_si128(m256),
                                          _mm256_extracti128_si256(m256, 1))
                           : _mm_max_epu8(_mm256_castsi256_si128(m256),
                                          _mm256_extracti128_si256(m256, 1));
  uint8_t mb[16];
  _mm_storeu_si128((__m128i*)mb, m128);
  int mxv = is_signed ? (int8_t)mb[0] : mb[0];
  for (int i = 1; i < 16; ++i) {
    const int x = is_signed ? (int8_t)mb[i] : mb[i];
    mxv = x > mxv ? x : mxv;
  }
  const __m512i mx = _mm512_set1_epi8((char)mxv);
  const uint8_t* e0 = tables + 4 * 256;
  __m512i tot = _mm512_setzero_si512();
  for (int64_t j = 0; j < s64; j += 64) {
    const __m512i dist = _mm512_sub_epi8(mx, _mm512_load_si512((const void*)(codes + j)));
    const __m512i b0 = lut256(dist, e0), b1 = lut256(dist, e0 + 256),
                  b2 = lut256(dist, e0 + 512);
    for (int u = 0; u < 4 && j + 16 * u < sp; ++u) {
      __m512i e = _mm512_or_si512(
          _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b0, u)),
          _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b1, u)), 8));
      e = _mm512_or_si512(e, _mm512_slli_epi32(
          _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b2, u)), 16));
      e = _mm512_maskz_mov_epi32(live16(s - j - 16 * u), e);
      _mm512_store_si512((void*)(row + j + 16 * u), e);
      tot = _mm512_add_epi32(tot, e);
    }
  }
  return _mm512_reduce_add_epi32(tot);
}

void qk_attention_u8(const uint8_t* qb, int64_t qo, const uint8_t* kb, int64_t ko,
                     const uint8_t* vb, int64_t vo, const int64_t* mb, int64_t mo,
                     const int64_t* pb, int64_t po, uint8_t* yb, int64_t yo, int64_t head,
                     int64_t chunk, int64_t n) {
  const int64_t* h = pb + po;
  const int64_t s = h[A_S], d = h[A_D], quads = d >> 2;
  const int64_t sp = (s + 15) & ~(int64_t)15;      // keys padded to 16 (score vectors)
  const int64_t s4 = (s + 3) & ~(int64_t)3;        // keys padded to 4 (P·V quads)
  const int64_t dp = (d + 15) & ~(int64_t)15;      // output columns padded to 16
  const int32_t* mtab = (const int32_t*)(h + A_HEADER);
  const int32_t* etab = mtab + 4 * 256;
  const int64_t ldk = h[A_LDK], ldv = h[A_LDV];
  const uint8_t* q = qb + qo + n * s * h[A_LDQ] + head * d;
  const uint8_t* k = kb + ko + n * s * ldk + head * d;
  const uint8_t* v = vb + vo + n * s * ldv + head * d;
  uint8_t* y = yb + yo + n * s * h[A_LDO] + head * d;
  const uint32_t qx = h[A_QFLIP] ? 0x80808080u : 0, kx = h[A_KFLIP] ? 0x80808080u : 0;
  const __m128i vx = _mm_set1_epi8(h[A_VFLIP] ? (char)0x80 : 0);
  const int n1 = (int)h[A_NARROW1], n2 = (int)h[A_NARROW2];
  int8_t kp[A_MAXSD] __attribute__((aligned(64)));
  int8_t vp[A_MAXSD] __attribute__((aligned(64)));
  int32_t colk[A_MAXS] __attribute__((aligned(64)));
  int32_t offs[A_MAXS] __attribute__((aligned(64)));
  int32_t row[A_MAXS] __attribute__((aligned(64)));
  uint8_t prow[A_MAXS] __attribute__((aligned(64)));
  int32_t colv[128] __attribute__((aligned(64)));
  const __m512i ones = _mm512_set1_epi8(1);
  // K: k' = k - 128 (s8) per dword of 4 columns, keys past S zero; its column sums by vpdpbusd
  for (int64_t j = 0; j < sp; ++j) {
    int8_t* dst = kp + ((j >> 4) * quads << 6) + ((j & 15) << 2);
    for (int64_t t = 0; t < quads; ++t) {
      uint32_t w = 0;
      if (j < s) {
        __builtin_memcpy(&w, k + j * ldk + 4 * t, 4);
        w ^= kx;
      }
      __builtin_memcpy(dst + (t << 6), &w, 4);
    }
  }
  for (int64_t jb = 0; jb < sp; jb += 16) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t t = 0; t < quads; ++t)
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_load_si512((const void*)(
          kp + (((jb >> 4) * quads + t) << 6))));
    _mm512_store_si512((void*)(colk + jb), acc);
  }
  // V: v' = v - 128 (s8), [S/4][dp][4] (4 keys interleaved per column), and its column sums
  for (int64_t jq = 0; jq < s4; jq += 4)
    for (int64_t c = 0; c < dp; c += 16) {
      const __mmask16 cm = live16(d - c);
      __m128i r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = jq + i < s ? _mm_xor_si128(_mm_maskz_loadu_epi8(cm, v + (jq + i) * ldv + c), vx)
                          : _mm_setzero_si128();
      for (int i = 0; i < 4; ++i) r[i] = _mm_maskz_mov_epi8(cm, r[i]);
      const __m128i a = _mm_unpacklo_epi8(r[0], r[1]), b = _mm_unpackhi_epi8(r[0], r[1]);
      const __m128i e = _mm_unpacklo_epi8(r[2], r[3]), f = _mm_unpackhi_epi8(r[2], r[3]);
      __m128i* dst = (__m128i*)(vp + jq * dp + 4 * c);
      _mm_store_si128(dst, _mm_unpacklo_epi16(a, e));
      _mm_store_si128(dst + 1, _mm_unpackhi_epi16(a, e));
      _mm_store_si128(dst + 2, _mm_unpacklo_epi16(b, f));
      _mm_store_si128(dst + 3, _mm_unpackhi_epi16(b, f));
    }
  for (int64_t c = 0; c < dp; c += 16) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t jq = 0; jq < s4; jq += 4)
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_load_si512((const void*)(
          vp + jq * dp + 4 * c)));
    _mm512_store_si512((void*)(colv + c), acc);
  }
  // each key's mask-table row (the scores' codes index it from the dtype's low end)
  const int64_t* mask = mb + mo + (h[A_MASKN] > 1 ? n * s : 0);
  uint8_t rowid[A_MAXS] __attribute__((aligned(64)));
  for (int64_t j = 0; j < A_MAXS; ++j) {
    int64_t r = 2;                      // no mask: row 2 (mask 1) is the identity
    if (h[A_MASK] && j < s) r = (mask[j] < -1 ? -1 : mask[j] > 2 ? 2 : mask[j]) + 1;
    if (j < sp) offs[j] = (int32_t)(r * 256 - h[A_CLO]);
    rowid[j] = (uint8_t)r;
  }
  const int vbmi = (int)h[A_VBMI];
  const uint8_t* btab = (const uint8_t*)(etab + 256);    // the byte tables (A_VBMI)
  const int64_t zq = h[A_ZQ], zk = h[A_ZK], zv = h[A_ZV], zp = h[A_ZP];
  const __m512d m2 = _mm512_set1_pd((double)(2 * h[A_SM]));
  const __m512d szp = _mm512_set1_pd((double)h[A_SZ]);
  const __m512d slo = _mm512_set1_pd((double)h[A_SLO]), shi = _mm512_set1_pd((double)h[A_SHI]);
  const int64_t nv = dp >> 4;
  const int64_t r0 = chunk * h[A_ROWS];
  const int64_t r1 = r0 + h[A_ROWS] < s ? r0 + h[A_ROWS] : s;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* qr = q + r * h[A_LDQ];
    uint32_t qw[32];
    int32_t sumq = 0;
    for (int64_t t = 0; t < quads; ++t) {
      uint32_t w;
      __builtin_memcpy(&w, qr + 4 * t, 4);
      qw[t] = w ^ qx;
      sumq += (int32_t)(qw[t] & 255) + (int32_t)((qw[t] >> 8) & 255) +
              (int32_t)((qw[t] >> 16) & 255) + (int32_t)(qw[t] >> 24);
    }
    const __m512i rowc = _mm512_set1_epi32((int32_t)(d * zq * zk - zk * sumq));
    const __m512i vzq = _mm512_set1_epi32((int32_t)zq);
    // four key blocks at a time: four independent vpdpbusd chains
    for (int64_t jb0 = 0; jb0 < sp; jb0 += 64) {
      const int nb = sp - jb0 >= 64 ? 4 : (int)((sp - jb0) >> 4);
      __m512i acc[4];
      for (int u = 0; u < 4; ++u) acc[u] = _mm512_setzero_si512();
      const int8_t* kb16 = kp + ((jb0 >> 4) * quads << 6);
      if (nb == 4) {
        for (int64_t t = 0; t < quads; ++t) {
          const __m512i qv = _mm512_set1_epi32((int32_t)qw[t]);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u)
            acc[u] = _mm512_dpbusd_epi32(acc[u], qv, _mm512_load_si512((const void*)(
                kb16 + ((u * quads + t) << 6))));
        }
      } else {
        for (int64_t t = 0; t < quads; ++t) {
          const __m512i qv = _mm512_set1_epi32((int32_t)qw[t]);
          for (int u = 0; u < nb; ++u)
            acc[u] = _mm512_dpbusd_epi32(acc[u], qv, _mm512_load_si512((const void*)(
                kb16 + ((u * quads + t) << 6))));
        }
      }
      for (int u = 0; u < nb; ++u) {
        const int64_t jb = jb0 + 16 * u;
        __m512i a = _mm512_add_epi32(acc[u], rowc);
        a = _mm512_sub_epi32(a, _mm512_mullo_epi32(vzq, _mm512_load_si512(
            (const void*)(colk + jb))));
        _mm512_store_si512((void*)(row + jb), rq16_scalar(a, h + A_B1, n1));
      }
    }
    const int64_t total = vbmi ? row_exp_vbmi(row, rowid, btab, h[A_CLO], (int)h[A_SIGNED1], s,
                                              sp)
                               : row_exp_gather(row, offs, mtab, etab, s, sp);
    const __m512d base = _mm512_set1_pd((double)(total << 16));
    const __m512d den = _mm512_set1_pd((double)(total << 17));
    const __m512d inv = _mm512_set1_pd(1.0 / (double)(total << 17));
    __m512i psum = _mm512_setzero_si512();
    for (int64_t jb = 0; jb < sp; jb += 16) {
      __m512i e = _mm512_load_si512((const void*)(row + jb));
      __m256i lo = softmax8(_mm512_castsi512_si256(e), m2, base, den, inv, szp, slo, shi);
      __m256i hi = softmax8(_mm512_extracti64x4_epi64(e, 1), m2, base, den, inv, szp, slo, shi);
      __m512i p = _mm512_maskz_mov_epi32(live16(s - jb), _mm512_inserti64x4(
          _mm512_castsi256_si512(lo), hi, 1));
      psum = _mm512_add_epi32(psum, p);
      _mm_store_si128((__m128i*)(prow + jb), _mm512_cvtepi32_epi8(p));
    }
    const int32_t sump = _mm512_reduce_add_epi32(psum);
    // P·V with 4 sets of accumulators over the key quads (independent vpdpbusd chains);
    // prow is zero from S to the next multiple of 16, vp to the next multiple of 4
    __m512i acc[8];
    for (int64_t c = 0; c < nv; ++c) acc[c] = _mm512_setzero_si512();
    if (nv <= 2) {
      __m512i ac[4][2];
      for (int u = 0; u < 4; ++u) ac[u][0] = ac[u][1] = _mm512_setzero_si512();
      int64_t jq = 0;
      for (; jq + 16 <= s4; jq += 16)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
          int32_t w;
          __builtin_memcpy(&w, prow + jq + 4 * u, 4);
          const __m512i pw = _mm512_set1_epi32(w);
          const int8_t* vq = vp + (jq + 4 * u) * dp;
          ac[u][0] = _mm512_dpbusd_epi32(ac[u][0], pw, _mm512_load_si512((const void*)vq));
          if (nv == 2)
            ac[u][1] = _mm512_dpbusd_epi32(ac[u][1], pw, _mm512_load_si512((const void*)(
                vq + 64)));
        }
      for (; jq < s4; jq += 4) {
        int32_t w;
        __builtin_memcpy(&w, prow + jq, 4);
        const __m512i pw = _mm512_set1_epi32(w);
        const int8_t* vq = vp + jq * dp;
        ac[0][0] = _mm512_dpbusd_epi32(ac[0][0], pw, _mm512_load_si512((const void*)vq));
        if (nv == 2)
          ac[0][1] = _mm512_dpbusd_epi32(ac[0][1], pw, _mm512_load_si512((const void*)(
              vq + 64)));
      }
      for (int64_t c = 0; c < nv; ++c)
        acc[c] = _mm512_add_epi32(_mm512_add_epi32(ac[0][c], ac[1][c]),
                                  _mm512_add_epi32(ac[2][c], ac[3][c]));
    } else {
      for (int64_t jq = 0; jq < s4; jq += 4) {
        int32_t w;
        __builtin_memcpy(&w, prow + jq, 4);
        const __m512i pw = _mm512_set1_epi32(w);
        const int8_t* vq = vp + jq * dp;
        for (int64_t c = 0; c < nv; ++c)
          acc[c] = _mm512_dpbusd_epi32(acc[c], pw, _mm512_load_si512((const void*)(
              vq + 64 * c)));
      }
    }
    const __m512i pc = _mm512_set1_epi32((int32_t)(s * zp * zv - zv * sump));
    const __m512i vzp = _mm512_set1_epi32((int32_t)zp);
    uint8_t* yr = y + r * h[A_LDO];
    for (int64_t c = 0; c < nv; ++c) {
      __m512i a = _mm512_add_epi32(acc[c], pc);
      a = _mm512_sub_epi32(a, _mm512_mullo_epi32(vzp, _mm512_load_si512((const void*)(
          colv + 16 * c))));
      __m512i o = rq16_scalar(a, h + A_B2, n2);
      _mm_mask_storeu_epi8((void*)(yr + 16 * c), live16(d - 16 * c), _mm512_cvtepi32_epi8(o));
    }
  }
}

// Depthwise conv (one filter per channel, groups == C == F) with the requantize epilogue, for
// AVX-512 VBMI hosts. The weights are packed per 16 channels as [KH][G][16][4] s8, G = ceil(KW /
// 3): taps 3g..3g+2 of one kernel row of each channel in one dword (the fourth byte and taps
// past KW zero), the operand vpdpbusd wants. For P output pixels of one output row at a time
// (P = 4 at stride 1, 3 at stride 2), each tap group of a kernel row loads the input pixels
// they read from (ox · SW + 3g) (up to 8), and a vpermt2b per 16 channels gathers the taps
// into those dwords from two registers: at stride 2 one per output pixel, at stride 1 one per
// two (pixels j..j+3: bytes 0..2 for output j, 1..3 with the weights one byte up for j + 1).
// Per 16 outputs and tap group: one vpdpbusd, one or half a vpermt2b, and the loads.
// Channels go 32 at a time (pixel pairs [p, p + 1] of 32 channels per register), a last block
// of 16 on its own (16 channels of 4 pixels per register). At stride 1 two output rows go
// together, each input row permuted once for both (dw_pair32). The input is padded by its zero
// point (the bias holds -zp_x · sum w), C a multiple of 16. One call is two output rows of
// image n for one block of 64 channels (grid (ceil(C / 64), ceil(OH / 2), N)).
#define DW_INLINE static inline __attribute__((always_inline, target("avx512vbmi")))

// 16 channels of one pixel, stored alone (the lean epilogue of a one-group row packs instead)
DW_INLINE void dw_store(__m512i v, const rq_regs* q, const epi_args* e, int64_t c, uint8_t* y,
                        const int lean) {
  if (lean)
    store16_lean(v, q, 0, y, 0xFFFF, LEAN);
  else if (e->narrow)
    store16_narrow(v, e, c, 0, y, 0xFFFF);
  else
    store16(v, e, c, 0, y, 0xFFFF);
}

// the byte offsets of the 8 pixels from `first + 3g` of each tap group g (those past the row
// repeat its last pixel: they only feed outputs past OW or taps whose weight is zero)
DW_INLINE void dw_offsets(int64_t off[3][8], int64_t first, int64_t groups, int64_t wp,
                          int64_t c) {
  for (int64_t g = 0; g < groups; ++g)
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const int64_t px = first + 3 * g + t;
      off[g][t] = (px < wp - 1 ? px : wp - 1) * c;
    }
}

// 32 channels of the two pixels at byte offsets o[0] and o[1] of row r (one register)
DW_INLINE __m512i dw_pixels2x32(const uint8_t* r, const int64_t* o) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(r + o[0]))),
                            _mm256_loadu_si256((const __m256i*)(r + o[1])), 1);
}

// 16 channels of the four pixels at byte offsets o[0..3] of row r (one register)
DW_INLINE __m512i dw_pixels4x16(const uint8_t* r, const int64_t* o) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(r + o[0])));
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(r + o[1])), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(r + o[2])), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(r + o[3])), 3);
}

// 32 channels of one output pixel
DW_INLINE void dw_out32(__m512i a0, __m512i a1, const rq_regs* q0, const rq_regs* q1,
                        const pack_regs* pk, const epi_args* e, int64_t c0, uint8_t* y,
                        int64_t groups, const int lean) {
  if (lean && groups == 1) {     // (wider kernels run short of registers for the packs)
    const __m512i v[2] = {rq16_lean(a0, q0, 0, 0xFFFF, LEAN), rq16_lean(a1, q1, 0, 0xFFFF, LEAN)};
    store_packed(v, 2, pk, y, 32);
    return;
  }
  dw_store(a0, q0, e, c0, y, lean);
  dw_store(a1, q1, e, c0 + 16, y + 16, lean);
}

// 16 channels of one output pixel
DW_INLINE void dw_out16(__m512i a, const rq_regs* q, const pack_regs* pk, const epi_args* e,
                        int64_t c0, uint8_t* y, int64_t groups, const int lean) {
  if (lean && groups == 1)
    store_packed((__m512i[1]){rq16_lean(a, q, 0, 0xFFFF, LEAN)}, 1, pk, y, 16);
  else
    dw_store(a, q, e, c0, y, lean);
}

// one output row, 32 channels from c0 (x, y and w at those channels)
DW_INLINE void dw_row32(const uint8_t* x, int64_t c, int64_t row, int64_t kh, int64_t groups,
                        int64_t wp, int64_t ow, const int8_t* w, int64_t kbytes,
                        const __m512i idx[2][2], const epi_args* e, int64_t c0, uint8_t* y,
                        int64_t f, const int S, const int P, const int lean) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i init0 = e->narrow ? _mm512_loadu_si512((const void*)(e->bias32 + c0)) : zero;
  const __m512i init1 = e->narrow ? _mm512_loadu_si512((const void*)(e->bias32 + c0 + 16)) : zero;
  const rq_regs q0 = rq_at(e, c0), q1 = rq_at(e, c0 + 16);
  const pack_regs pk = pack_at(e);
  for (int64_t ox = 0; ox < ow; ox += P) {
    int64_t off[3][8];
    dw_offsets(off, ox * S, groups, wp, c);
    __m512i acc[6][2];
#pragma GCC unroll 6
    for (int j = 0; j < P; ++j) { acc[j][0] = init0; acc[j][1] = init1; }
    for (int64_t i = 0; i < kh; ++i) {
      const uint8_t* r = x + i * row;
      if (S == 2 && groups == 2) {
        // output j's taps 3..4 (pixels 2j+3, 2j+4) are bytes 1..2 of output j + 1's operand
        // (pixels 2j+2..2j+5): with the second group's weights one byte up, the operands of
        // outputs j..j+3 serve both groups (4 a half for 3 outputs instead of 6)
        __m512i z[5], v[4][2];
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) z[k] = dw_pixels2x32(r, off[0] + 2 * k);
        z[4] = dw_pixels2x32(r, off[1] + 5);                  // pixels 8, 9
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h)
            v[k][h] = _mm512_permutex2var_epi8(z[k], idx[0][h], z[k + 1]);
        const int8_t* wg = w + 128 * i;
        const __m512i w0 = _mm512_loadu_si512((const void*)wg);
        const __m512i w1 = _mm512_loadu_si512((const void*)(wg + kbytes));
        const __m512i u0 = _mm512_slli_epi32(_mm512_loadu_si512((const void*)(wg + 64)), 8);
        const __m512i u1 = _mm512_slli_epi32(
            _mm512_loadu_si512((const void*)(wg + 64 + kbytes)), 8);
#pragma GCC unroll 3
        for (int j = 0; j < P; ++j) {
          acc[j][0] = _mm512_dpbusd_epi32(acc[j][0], v[j][0], w0);
          acc[j][1] = _mm512_dpbusd_epi32(acc[j][1], v[j][1], w1);
          acc[j][0] = _mm512_dpbusd_epi32(acc[j][0], v[j + 1][0], u0);
          acc[j][1] = _mm512_dpbusd_epi32(acc[j][1], v[j + 1][1], u1);
        }
        continue;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t* o = off[g];
        __m512i z[4];
#pragma GCC unroll 4
        for (int k = 0; k < ((P - 1) * S + 4) / 2; ++k)   // the pairs of the pixels read
          z[k] = dw_pixels2x32(r, o + 2 * k);
        const int8_t* wg = w + 64 * (i * groups + g);
        const __m512i w0 = _mm512_loadu_si512((const void*)wg);
        const __m512i w1 = _mm512_loadu_si512((const void*)(wg + kbytes));
        if (S == 1) {
          // pixels j..j+3 feed output j with the taps in bytes 0..2 and output j + 1 with
          // the same weights one byte up: one vpermt2b for two outputs
          const __m512i u0 = _mm512_slli_epi32(w0, 8), u1 = _mm512_slli_epi32(w1, 8);
#pragma GCC unroll 3
          for (int j = 0; j < P; j += 2) {
            const __m512i v0 = _mm512_permutex2var_epi8(z[j / 2], idx[0][0], z[j / 2 + 1]);
            const __m512i v1 = _mm512_permutex2var_epi8(z[j / 2], idx[0][1], z[j / 2 + 1]);
            acc[j][0] = _mm512_dpbusd_epi32(acc[j][0], v0, w0);
            acc[j][1] = _mm512_dpbusd_epi32(acc[j][1], v1, w1);
            acc[j + 1][0] = _mm512_dpbusd_epi32(acc[j + 1][0], v0, u0);
            acc[j + 1][1] = _mm512_dpbusd_epi32(acc[j + 1][1], v1, u1);
          }
          continue;
        }
#pragma GCC unroll 6
        for (int j = 0; j < P; ++j) {
          const int a = (j * S) >> 1, par = (j * S) & 1;
          acc[j][0] = _mm512_dpbusd_epi32(
              acc[j][0], _mm512_permutex2var_epi8(z[a], idx[par][0], z[a + 1]), w0);
          acc[j][1] = _mm512_dpbusd_epi32(
              acc[j][1], _mm512_permutex2var_epi8(z[a], idx[par][1], z[a + 1]), w1);
        }
      }
    }
#pragma GCC unroll 6
    for (int j = 0; j < P; ++j) {
      if (ox + j >= ow) break;
      dw_out32(acc[j][0], acc[j][1], &q0, &q1, &pk, e, c0, y + (ox + j) * f, groups, lean);
    }
  }
}

// The packed weights of kernel row and tap group rg (i · groups + g), 16-channel half h, copy v.
// At stride 1 the object holds, per 16 channels, copies of the packed weights after one another
// (pack_dw_weights, `kb` bytes each; `kbytes` is all of them): as packed (the first output of
// a stride-1 pixel pair), one byte up (the second: its taps are bytes 1..3 of the pair's
// operand) and, with two tap groups, two bytes up (dw_pair32's second group). So the two-row
// form reads them as it finds them, with no per-call copy.
DW_INLINE __m512i dw_w(const int8_t* w, int64_t kbytes, int64_t kb, int64_t rg, int h, int v) {
  return _mm512_loadu_si512((const void*)(w + h * kbytes + v * kb + 64 * rg));
}

// copy v of the weights of kernel row and tap group rg, half h: from registers for a 3x3 kernel
#define DW_WT(rg, h, v) (form == DW_3X3 ? wr[rg][h][v] : dw_w(w, kbytes, kb, rg, h, v))

// the two-row form's kernels (compiled apart): 3x3, two tap groups (KW 4 or 5), any other
enum { DW_ANY = 0, DW_3X3 = 1, DW_G2 = 2 };

// a 3x3 kernel's weights of `halves` 16-channel halves in registers for the call (the compiler
// cannot keep ones it reads through w there: the output stores may alias them)
DW_INLINE void dw_regs3x3(__m512i wr[3][2][2], const int8_t* w, int64_t kbytes, int64_t kb,
                          int halves) {
  for (int i = 0; i < 3; ++i)
    for (int h = 0; h < halves; ++h)
      for (int v = 0; v < 2; ++v) wr[i][h][v] = dw_w(w, kbytes, kb, i, h, v);
}

// Kernel row i of a two-tap-group kernel (KW 4 or 5) for outputs 0..3 of one output row and
// half h, their accumulators a[0], a[step], a[2 step], a[3 step]: pixels j..j+3 (operand Oj)
// feed output j by the first group's weights as packed and j + 1 one byte up; the second
// group's taps of outputs 0..3 lie in bytes 1..2 of O2 and 0..1, 1..2, 2..3 of O4 (its weights
// one byte up, as packed, one and two bytes up). So O0, O2 and O4 serve both groups: 3 operands
// (and 4 pixel pairs) a half instead of 4 (and 6).
DW_INLINE void dw_g2_sums(__m512i* a, int step, __m512i o0, __m512i o2, __m512i o4,
                          const int8_t* w, int64_t kbytes, int64_t kb, int64_t i, int h) {
  const __m512i p0 = dw_w(w, kbytes, kb, 2 * i, h, 0), p1 = dw_w(w, kbytes, kb, 2 * i, h, 1);
  const __m512i q0 = dw_w(w, kbytes, kb, 2 * i + 1, h, 0);
  const __m512i q1 = dw_w(w, kbytes, kb, 2 * i + 1, h, 1);
  a[0] = _mm512_dpbusd_epi32(a[0], o0, p0);
  a[step] = _mm512_dpbusd_epi32(a[step], o0, p1);
  a[2 * step] = _mm512_dpbusd_epi32(a[2 * step], o2, p0);
  a[3 * step] = _mm512_dpbusd_epi32(a[3 * step], o2, p1);
  a[0] = _mm512_dpbusd_epi32(a[0], o2, q1);
  a[step] = _mm512_dpbusd_epi32(a[step], o4, q0);
  a[2 * step] = _mm512_dpbusd_epi32(a[2 * step], o4, q1);
  a[3 * step] = _mm512_dpbusd_epi32(a[3 * step], o4, dw_w(w, kbytes, kb, 2 * i + 1, h, 2));
}

// Two output rows at stride 1 (the input row pitch `row` apart, outputs yrow apart), 32
// channels from c0: input row t is read and permuted once for both, as kernel row t of the
// first output row and t - 1 of the second. Four outputs of each row at a time.
DW_INLINE void dw_pair32(const uint8_t* x, int64_t c, int64_t row, int64_t kh, int64_t groups,
                         int64_t wp, int64_t ow, const int8_t* w, int64_t kbytes, int64_t kb,
                         const __m512i idx[2][2],
                         const epi_args* e, int64_t c0, uint8_t* y, int64_t yrow, int64_t f,
                         const int lean, const int form) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i init0 = e->narrow ? _mm512_loadu_si512((const void*)(e->bias32 + c0)) : zero;
  const __m512i init1 = e->narrow ? _mm512_loadu_si512((const void*)(e->bias32 + c0 + 16)) : zero;
  const rq_regs q0 = rq_at(e, c0), q1 = rq_at(e, c0 + 16);
  const pack_regs pk = pack_at(e);
  __m512i wr[3][2][2];
  if (form == DW_3X3) dw_regs3x3(wr, w, kbytes, kb, 2);
  for (int64_t ox = 0; ox < ow; ox += 4) {
    int64_t off[3][8];
    dw_offsets(off, ox, groups, wp, c);
    __m512i acc[2][4][2];
#pragma GCC unroll 2
    for (int r = 0; r < 2; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) { acc[r][j][0] = init0; acc[r][j][1] = init1; }
    for (int64_t t = 0; t <= kh; ++t) {
      const uint8_t* rp = x + t * row;
      if (form == DW_G2) {           // O0, O2 and O4 serve both tap groups (dw_g2_sums)
        __m512i z[4], v[3][2];
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) z[k] = dw_pixels2x32(rp, off[0] + 2 * k);
#pragma GCC unroll 3
        for (int k = 0; k < 3; ++k)
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h)
            v[k][h] = _mm512_permutex2var_epi8(z[k], idx[0][h], z[k + 1]);
#pragma GCC unroll 2
        for (int r = 0; r < 2; ++r) {
          const int64_t i = t - r;                    // this output row's kernel row
          if (i < 0 || i >= kh) continue;
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h)
            dw_g2_sums(&acc[r][0][h], 2, v[0][h], v[1][h], v[2][h], w, kbytes, kb, i, h);
        }
        continue;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t* o = off[g];
        __m512i z[3];
#pragma GCC unroll 3
        for (int k = 0; k < 3; ++k)
          z[k] = dw_pixels2x32(rp, o + 2 * k);
#pragma GCC unroll 2
        for (int j = 0; j < 4; j += 2) {
          const __m512i v0 = _mm512_permutex2var_epi8(z[j / 2], idx[0][0], z[j / 2 + 1]);
          const __m512i v1 = _mm512_permutex2var_epi8(z[j / 2], idx[0][1], z[j / 2 + 1]);
#pragma GCC unroll 2
          for (int r = 0; r < 2; ++r) {
            const int64_t i = t - r;                  // this output row's kernel row
            if (i < 0 || i >= kh) continue;
            const int64_t rg = i * groups + g;
            acc[r][j][0] = _mm512_dpbusd_epi32(acc[r][j][0], v0, DW_WT(rg, 0, 0));
            acc[r][j][1] = _mm512_dpbusd_epi32(acc[r][j][1], v1, DW_WT(rg, 1, 0));
            acc[r][j + 1][0] = _mm512_dpbusd_epi32(acc[r][j + 1][0], v0, DW_WT(rg, 0, 1));
            acc[r][j + 1][1] = _mm512_dpbusd_epi32(acc[r][j + 1][1], v1, DW_WT(rg, 1, 1));
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < 2; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        if (ox + j >= ow) break;
        dw_out32(acc[r][j][0], acc[r][j][1], &q0, &q1, &pk, e, c0, y + r * yrow + (ox + j) * f,
                 groups, lean);
      }
  }
}

// dw_pair32 for 16 channels from c0 (the last block when C is no multiple of 32)
DW_INLINE void dw_pair16(const uint8_t* x, int64_t c, int64_t row, int64_t kh, int64_t groups,
                         int64_t wp, int64_t ow, const int8_t* w, int64_t kbytes, int64_t kb,
                         const __m512i* idx,
                         const epi_args* e, int64_t c0, uint8_t* y, int64_t yrow, int64_t f,
                         const int lean, const int form) {
  const __m512i init = e->narrow ? _mm512_loadu_si512((const void*)(e->bias32 + c0))
                                 : _mm512_setzero_si512();
  const rq_regs q = rq_at(e, c0);
  const pack_regs pk = pack_at(e);
  __m512i wr[3][2][2];
  if (form == DW_3X3) dw_regs3x3(wr, w, kbytes, kb, 1);
  for (int64_t ox = 0; ox < ow; ox += 4) {
    int64_t off[3][8];
    dw_offsets(off, ox, groups, wp, c);
    __m512i acc[2][4];
#pragma GCC unroll 2
    for (int r = 0; r < 2; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = init;
    for (int64_t t = 0; t <= kh; ++t) {
      const uint8_t* rp = x + t * row;
      if (form == DW_G2) {           // O0, O2 and O4 serve both tap groups (dw_g2_sums)
        __m512i z[2], v[3];
#pragma GCC unroll 2
        for (int k = 0; k < 2; ++k) z[k] = dw_pixels4x16(rp, off[0] + 4 * k);
#pragma GCC unroll 3
        for (int k = 0; k < 3; ++k) v[k] = _mm512_permutex2var_epi8(z[0], idx[2 * k], z[1]);
#pragma GCC unroll 2
        for (int r = 0; r < 2; ++r) {
          const int64_t i = t - r;
          if (i < 0 || i >= kh) continue;
          dw_g2_sums(&acc[r][0], 1, v[0], v[1], v[2], w, kbytes, kb, i, 0);
        }
        continue;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t* o = off[g];
        __m512i z[2];
#pragma GCC unroll 2
        for (int k = 0; k < 2; ++k) z[k] = dw_pixels4x16(rp, o + 4 * k);
#pragma GCC unroll 2
        for (int j = 0; j < 4; j += 2) {
          const __m512i v = _mm512_permutex2var_epi8(z[0], idx[j], z[1]);
#pragma GCC unroll 2
          for (int r = 0; r < 2; ++r) {
            const int64_t i = t - r;
            if (i < 0 || i >= kh) continue;
            const int64_t rg = i * groups + g;
            acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], v, DW_WT(rg, 0, 0));
            acc[r][j + 1] = _mm512_dpbusd_epi32(acc[r][j + 1], v, DW_WT(rg, 0, 1));
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < 2; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        if (ox + j >= ow) break;
        dw_out16(acc[r][j], &q, &pk, e, c0, y + r * yrow + (ox + j) * f, groups, lean);
      }
  }
}

// one output row, 16 channels from c0 (the last block when C is no multiple of 32)
DW_INLINE void dw_row16(const uint8_t* x, int64_t c, int64_t row, int64_t kh, int64_t groups,
                        int64_t wp, int64_t ow, const int8_t* w, const __m512i* idx,
                        const epi_args* e, int64_t c0, uint8_t* y, int64_t f, const int S,
                        const int P, const int lean) {
  const __m512i init = e->narrow ? _mm512_loadu_si512((const void*)(e->bias32 + c0))
                                 : _mm512_setzero_si512();
  const rq_regs q = rq_at(e, c0);
  const pack_regs pk = pack_at(e);
  for (int64_t ox = 0; ox < ow; ox += P) {
    int64_t off[3][8];
    dw_offsets(off, ox * S, groups, wp, c);
    __m512i acc[6];
#pragma GCC unroll 6
    for (int j = 0; j < P; ++j) acc[j] = init;
    for (int64_t i = 0; i < kh; ++i) {
      const uint8_t* r = x + i * row;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t* o = off[g];
        __m512i z[2];
#pragma GCC unroll 2
        for (int k = 0; k < 2; ++k) z[k] = dw_pixels4x16(r, o + 4 * k);
        const __m512i wv = _mm512_loadu_si512((const void*)(w + 64 * (i * groups + g)));
        if (S == 1) {          // one vpermt2b for two outputs, as in dw_row32
          const __m512i uv = _mm512_slli_epi32(wv, 8);
#pragma GCC unroll 3
          for (int j = 0; j < P; j += 2) {
            const __m512i v = _mm512_permutex2var_epi8(z[0], idx[j], z[1]);
            acc[j] = _mm512_dpbusd_epi32(acc[j], v, wv);
            acc[j + 1] = _mm512_dpbusd_epi32(acc[j + 1], v, uv);
          }
          continue;
        }
#pragma GCC unroll 6
        for (int j = 0; j < P; ++j)
          acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_permutex2var_epi8(z[0], idx[j], z[1]), wv);
      }
    }
#pragma GCC unroll 6
    for (int j = 0; j < P; ++j) {
      if (ox + j >= ow) break;
      dw_out16(acc[j], &q, &pk, e, c0, y + (ox + j) * f, groups, lean);   // C: a multiple of 16
    }
  }
}

// What one call's variants read (qk_dwconv_u8s8 sets it up)
typedef struct {
  const uint8_t* x;        // the first output row's input rows
  uint8_t* y;              // the first output row
  const int8_t* w;         // the packed weights (all channels)
  const epi_args* e;
  const __m512i* idx16;    // [6]
  const __m512i (*idx32)[2];
  int64_t c, wp, ow, f, kh, groups, kbytes, kb, cb, ce;   // kb: one copy of the weights
} dw_call;

#define DW_UNPACK(d)                                                                         \
  const uint8_t* x = (d)->x;                                                                 \
  uint8_t* y = (d)->y;                                                                       \
  const epi_args* e = (d)->e;                                                                \
  const int64_t c = (d)->c, wp = (d)->wp, ow = (d)->ow, f = (d)->f, kbytes = (d)->kbytes;    \
  const int64_t cb = (d)->cb, ce = (d)->ce;                                                  \
  (void)kbytes

#define DW_PAIRS(LEAN, FORM)                                                                 \
  for (int64_t c0 = cb; c0 < ce; c0 += 32) {                                                 \
    const int8_t* w = d->w + (c0 >> 4) * kbytes;                                             \
    if (c0 + 32 <= ce)                                                                       \
      dw_pair32(x + c0, c, wp * c, kh, groups, wp, ow, w, kbytes, d->kb, d->idx32, e, c0,    \
                y + c0, ow * f, f, LEAN, FORM);                                              \
    else                                                                                     \
      dw_pair16(x + c0, c, wp * c, kh, groups, wp, ow, w, kbytes, d->kb, d->idx16, e, c0,    \
                y + c0, ow * f, f, LEAN, FORM);                                              \
  }

#define DW_ROWS(S, P, LEAN)                                                                  \
  for (int64_t c0 = cb; c0 < ce; c0 += 32) {                                                 \
    const int8_t* w = d->w + (c0 >> 4) * kbytes;                                             \
    if (c0 + 32 <= ce)                                                                       \
      dw_row32(x + c0, c, wp * c, kh, groups, wp, ow, w, kbytes, d->idx32, e, c0, y + c0, f, \
               S, P, LEAN);                                                                  \
    else                                                                                     \
      dw_row16(x + c0, c, wp * c, kh, groups, wp, ow, w, d->idx16, e, c0, y + c0, f, S, P,   \
               LEAN);                                                                        \
  }

// the common kernels with their loop counts known (3x3, 5x5), the rest generic
#define DW_KERNELS(ROWS, ...)                                                                \
  if (d->kh == 3 && d->groups == 1) {                                                        \
    const int64_t kh = 3, groups = 1;                                                        \
    ROWS(__VA_ARGS__)                                                                        \
  } else if (d->kh == 5 && d->groups == 2) {                                                 \
    const int64_t kh = 5, groups = 2;                                                        \
    ROWS(__VA_ARGS__)                                                                        \
  } else {                                                                                   \
    const int64_t kh = d->kh, groups = d->groups;                                            \
    ROWS(__VA_ARGS__)                                                                        \
  }

// each variant a function of its own (one function holding them all compiles worse)
#define DW_VARIANT(NAME, ROWS, ...)                                                          \
  __attribute__((noinline, target("avx512vbmi"))) static void NAME(const dw_call* d) {      \
    DW_UNPACK(d);                                                                            \
    DW_KERNELS(ROWS, __VA_ARGS__)                                                            \
  }
#define DW_PAIR_VARIANT(NAME, LEAN)                                                          \
  __attribute__((noinline, target("avx512vbmi"))) static void NAME(const dw_call* d) {      \
    DW_UNPACK(d);                                                                            \
    if (d->kh == 3 && d->groups == 1) {                                                      \
      const int64_t kh = 3, groups = 1;                                                      \
      DW_PAIRS(LEAN, DW_3X3)                                                                 \
    } else if (d->groups == 2) {  /* (5x5 with kh known compiled slower: spills) */         \
      const int64_t kh = d->kh, groups = 2;                                                  \
      DW_PAIRS(LEAN, DW_G2)                                                                  \
    } else {                                                                                 \
      const int64_t kh = d->kh, groups = d->groups;                                          \
      DW_PAIRS(LEAN, DW_ANY)                                                                 \
    }                                                                                        \
  }
DW_VARIANT(dw_s1_lean, DW_ROWS, 1, 4, 1)
DW_VARIANT(dw_s1, DW_ROWS, 1, 4, 0)
DW_VARIANT(dw_s2_lean, DW_ROWS, 2, 3, 1)
DW_VARIANT(dw_s2, DW_ROWS, 2, 3, 0)
DW_PAIR_VARIANT(dw_pair_lean, 1)
DW_PAIR_VARIANT(dw_pair, 0)

__attribute__((target("avx512vbmi")))
void qk_dwconv_u8s8(const uint8_t* xb, int64_t xo, const int8_t* wb, int64_t wo,
                    const int64_t* pb, int64_t po, const uint8_t* rb, int64_t ro,
                    uint8_t* yb, int64_t yo, int64_t blk, int64_t pair, int64_t n) {
  (void)rb; (void)ro;
  const int64_t* h = pb + po;
  const int64_t hp = h[H_HP], wp = h[H_WP], c = h[H_C], kh = h[H_KH], kw = h[H_KW];
  const int64_t sh = h[H_SH], sw = h[H_SW], ow = h[H_OW], f = h[H_F], ohn = h[H_OH];
  const int64_t groups = (kw + 2) / 3;
  epi_args e;
  epi_init(h, &e);
  // vpermt2b indices: byte 4 ch + t of output j's operand is tap t (pixel j·SW + t) of channel
  // ch; 16 channels: 4 pixels of 16 per register; 32: pixel pairs of 32 per register, from the
  // pair that holds pixel j·SW (its parity picks the pattern). Byte 3 (weight 0) is pixel
  // j·SW + 3 where the two registers hold it: the second output of a stride-1 pair reads it.
  __m512i idx16[6], idx32[2][2];
  for (int j = 0; j < 6; ++j) {
    uint8_t b[64];
    for (int ch = 0; ch < 16; ++ch)
      for (int t = 0; t < 4; ++t) {
        const int64_t px = j * sw + t;
        b[4 * ch + t] = (uint8_t)(16 * (px < 8 ? px : 7) + ch);
      }
    idx16[j] = _mm512_loadu_si512((const void*)b);
  }
  for (int par = 0; par < 2; ++par)
    for (int half = 0; half < 2; ++half) {
      uint8_t b[64];
      for (int ch = 0; ch < 16; ++ch)
        for (int t = 0; t < 4; ++t)
          b[4 * ch + t] = (uint8_t)(32 * (par + t < 4 ? par + t : 3) + 16 * half + ch);
      idx32[par][half] = _mm512_loadu_si512((const void*)b);
    }
  dw_call d;
  d.w = wb + wo;
  d.e = &e;
  d.idx16 = idx16;
  d.idx32 = (const __m512i(*)[2])idx32;
  d.c = c; d.wp = wp; d.ow = ow; d.f = f; d.kh = kh; d.groups = groups;
  // packed weights per 16 channels: at stride 1 copies as packed, one byte up and (two tap
  // groups) two bytes up for the two-row form (ukernel.dw_copies)
  d.kb = kh * groups * 64;
  d.kbytes = d.kb * (sh == 1 && sw == 1 ? (groups == 2 ? 3 : 2) : 1);
  d.cb = blk * 64;
  d.ce = d.cb + 64 < f ? d.cb + 64 : f;
  const int lean = lean_mode(&e) == LEAN;      // (no residual here; the plain k = 32 form)
  // output rows 2 pair and 2 pair + 1 (the last of an odd OH alone): at stride 1 both at once
  const int64_t oy = 2 * pair, rows = ohn - oy < 2 ? ohn - oy : 2;
  if (rows == 2 && sh == 1 && sw == 1) {
    d.x = xb + xo + (n * hp + oy) * wp * c;
    d.y = yb + yo + (n * ohn + oy) * ow * f;
    (lean ? dw_pair_lean : dw_pair)(&d);
    return;
  }
  for (int64_t r = oy; r < oy + rows; ++r) {
    d.x = xb + xo + (n * hp + r * sh) * wp * c;
    d.y = yb + yo + (n * ohn + r) * ow * f;
    (sw == 1 ? (lean ? dw_s1_lean : dw_s1) : (lean ? dw_s2_lean : dw_s2))(&d);
  }
}

// ---------------------------------------------------------------------------------------------
// Pooled entries (a module whose batch runs inline, IREE local-sync): one workgroup of grid
// (1, 1, 1) that shares the real grid (GX, GY, GZ) out over qcompile's thread pool (pool.c).
// The extra operand `ctx` holds {qk_pool_run, pool}; {0, 0} runs the grid on this thread.
typedef void (*qk_body)(void*, int64_t);
typedef void (*qk_run)(void*, int64_t, qk_body, void*);
// read by every workgroup on every thread: on cache lines of its own, apart from the caller's
// stack slots (which lines those are depends on where the stack lands)
typedef struct {
  _Alignas(64) const void* p[6];
  int64_t o[6];
  int64_t gx, gy, gz, serial;   // the grid, and whether this thread runs all of it
} par_args;

static void par_launch(const int64_t* ctx, int64_t n, qk_body body, par_args* a) {
  const qk_run run = (qk_run)(intptr_t)ctx[0];
  if (run) {
    run((void*)(intptr_t)ctx[1], n, body, a);
  } else {
    for (int64_t i = 0; i < n; ++i) body(a, i);
  }
}

// the grid in IREE's order (x, the channel blocks, fastest): the pool's caller takes the first
// pixels and its helpers the last, so two threads work on far-apart pixels until they meet
#define PAR_IDS(a, i) (i) % (a)->gx, (i) / (a)->gx % (a)->gy, (i) / ((a)->gx * (a)->gy)
// The convs' grid where one thread runs it all (the data-parallel shards; `serial`): the channel
// blocks slowest, so that a block's weights stay in L2 while every image's pixels stream past
// them (the pooled threads keep IREE's order, above). Same process, alternating windows:
// resnet50 batch 8 (shards of 4) 79.6 -> 78.5 ms, resnet18 batch 8 31.5 -> 31.2, mobilenet_v2
// and efficientnet_lite0 batch 8 unchanged (10.42 -> 10.37, 12.42 -> 12.48).
#define PAR_IDS_CONV(a, i)                                                                  \
  (a)->serial ? (i) / ((a)->gy * (a)->gz) : (i) % (a)->gx,                                 \
      (a)->serial ? (i) % (a)->gy : (i) / (a)->gx % (a)->gy,                               \
      (a)->serial ? (i) / (a)->gy % (a)->gz : (i) / ((a)->gx * (a)->gy)
#define PAR_ARG(a, k, T) (T)(a)->p[k], (a)->o[k]
#define PAR_SET(a, k, P, O) ((a).p[k] = (const void*)(P), (a).o[k] = (O))
#define PAR_ENTRY(NAME, ITEM_CALL, PARAMS, SETS)                                             \
  static void NAME##_item(void* v, int64_t i) {                                              \
    const par_args* a = (const par_args*)v;                                                  \
    ITEM_CALL;                                                                               \
  }                                                                                          \
  void NAME##_par(PARAMS, const int64_t* cb, int64_t co, int64_t gx, int64_t gy, int64_t gz) { \
    par_args a;                                                                              \
    SETS;                                                                                    \
    a.gx = gx; a.gy = gy; a.gz = gz; a.serial = !cb[co];                                     \
    par_launch(cb + co, gx * gy * gz, NAME##_item, &a);                                      \
  }

#define COMMA ,
#define P5(T0, T1, T2, T3, T4)                                                               \
  T0 p0, int64_t o0 COMMA T1 p1, int64_t o1 COMMA T2 p2, int64_t o2 COMMA T3 p3,             \
      int64_t o3 COMMA T4 p4, int64_t o4
#define S5 PAR_SET(a, 0, p0, o0); PAR_SET(a, 1, p1, o1); PAR_SET(a, 2, p2, o2);               \
           PAR_SET(a, 3, p3, o3); PAR_SET(a, 4, p4, o4)

PAR_ENTRY(qk_conv2d_u8s8,
          qk_conv2d_u8s8(PAR_ARG(a, 0, const uint8_t*), PAR_ARG(a, 1, const int8_t*),
                         PAR_ARG(a, 2, const int64_t*), PAR_ARG(a, 3, const uint8_t*),
                         PAR_ARG(a, 4, uint8_t*), PAR_IDS_CONV(a, i)),
          P5(const uint8_t*, const int8_t*, const int64_t*, const uint8_t*, uint8_t*), S5)
PAR_ENTRY(qk_wino_u8s8,
          qk_wino_u8s8(PAR_ARG(a, 0, const uint8_t*), PAR_ARG(a, 1, const int8_t*),
                       PAR_ARG(a, 2, const int64_t*), PAR_ARG(a, 3, const uint8_t*),
                       PAR_ARG(a, 4, uint8_t*), PAR_IDS_CONV(a, i)),
          P5(const uint8_t*, const int8_t*, const int64_t*, const uint8_t*, uint8_t*), S5)
PAR_ENTRY(qk_matmul_u8s8,
          qk_matmul_u8s8(PAR_ARG(a, 0, const uint8_t*), PAR_ARG(a, 1, const int8_t*),
                         PAR_ARG(a, 2, const int64_t*), PAR_ARG(a, 3, const int32_t*),
                         PAR_ARG(a, 4, uint8_t*), PAR_IDS(a, i)),
          P5(const uint8_t*, const int8_t*, const int64_t*, const int32_t*, uint8_t*), S5)
PAR_ENTRY(qk_dwconv_u8s8,
          qk_dwconv_u8s8(PAR_ARG(a, 0, const uint8_t*), PAR_ARG(a, 1, const int8_t*),
                         PAR_ARG(a, 2, const int64_t*), PAR_ARG(a, 3, const uint8_t*),
                         PAR_ARG(a, 4, uint8_t*), PAR_IDS(a, i)),
          P5(const uint8_t*, const int8_t*, const int64_t*, const uint8_t*, uint8_t*), S5)
// the pooled quantize also reports a NaN or infinity in its input: ctx[2], where not 0, points
// to the caller's flag (the module's input check, qcompile/codegen/iree_cpu.py)
PAR_ENTRY(qk_quantize_nchw,
          quantize_chunk(PAR_ARG(a, 0, const float*), PAR_ARG(a, 1, const int64_t*),
                         PAR_ARG(a, 2, uint8_t*), i % a->gx, i / (a->gx * a->gy),
                         (int64_t*)a->p[3]),
          const float* p0 COMMA int64_t o0 COMMA const int64_t* p1 COMMA int64_t o1 COMMA
              uint8_t* p2 COMMA int64_t o2,
          PAR_SET(a, 0, p0, o0); PAR_SET(a, 1, p1, o1); PAR_SET(a, 2, p2, o2);
          PAR_SET(a, 3, (const void*)(intptr_t)cb[co + 2], 0))
PAR_ENTRY(qk_linear_multi,
          qk_linear_multi(PAR_ARG(a, 0, const uint8_t*), PAR_ARG(a, 1, const int8_t*),
                          PAR_ARG(a, 2, const int64_t*), PAR_ARG(a, 3, uint8_t*),
                          PAR_IDS(a, i)),
          const uint8_t* p0 COMMA int64_t o0 COMMA const int8_t* p1 COMMA int64_t o1 COMMA
              const int64_t* p2 COMMA int64_t o2 COMMA uint8_t* p3 COMMA int64_t o3,
          PAR_SET(a, 0, p0, o0); PAR_SET(a, 1, p1, o1); PAR_SET(a, 2, p2, o2);
          PAR_SET(a, 3, p3, o3))
PAR_ENTRY(qk_attention_u8,
          qk_attention_u8(PAR_ARG(a, 0, const uint8_t*), PAR_ARG(a, 1, const uint8_t*),
                          PAR_ARG(a, 2, const uint8_t*), PAR_ARG(a, 3, const int64_t*),
                          PAR_ARG(a, 4, const int64_t*), PAR_ARG(a, 5, uint8_t*),
                          PAR_IDS(a, i)),
          P5(const uint8_t*, const uint8_t*, const uint8_t*, const int64_t*, const int64_t*)
              COMMA uint8_t* p5 COMMA int64_t o5,
          S5; PAR_SET(a, 5, p5, o5))
