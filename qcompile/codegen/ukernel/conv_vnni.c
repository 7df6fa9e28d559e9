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
  H_YFILL, H_NARROW, H_RES_ZP, H_SIGNED, H_CLAMP_LO, H_CLAMP_HI, H_ZFOLD, H_FLOAT,
  HEADER = 32
};

#define INLINE static inline __attribute__((always_inline))

typedef struct {
  const uint8_t* x;        // the (n) image, padded
  const int8_t* w;         // this channel block's packed weights
  int64_t row;             // bytes per padded input row (WP * C)
  int64_t c, kh, kw, sw, dh, dw;
} conv_args;

// Accumulators of MR output pixels x NR*16 channels; xs[m]: pixel m's window origin (the
// pixels of a tile may lie on different output rows).
INLINE void tile(const conv_args* a, const uint8_t* const* xs, __m512i acc[6][4], int MR,
                 int NR, const int32_t* init) {
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j)
      acc[m][j] = init ? _mm512_loadu_si512((const void*)(init + 16 * j)) : _mm512_setzero_si512();
  const int8_t* w = a->w;
  const int64_t quads = a->c >> 2;
  for (int64_t i = 0; i < a->kh; ++i) {
    for (int64_t k = 0; k < a->kw; ++k) {
      const int64_t off = i * a->dh * a->row + k * a->dw * a->c;
      for (int64_t q = 0; q < quads; ++q) {
        __m512i wv[4];
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512((const void*)(w + 64 * j));
        w += 64 * NR;
#pragma GCC unroll 6
        for (int m = 0; m < MR; ++m) {
          __m512i xv = _mm512_set1_epi32(*(const int32_t*)(xs[m] + off + 4 * q));
#pragma GCC unroll 4
          for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], xv, wv[j]);
        }
      }
    }
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
  int fout;                  // f32 out (a dequantize), residual f32; else int8
  int32_t res_zp;
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

// 16 channels starting at c (of which `mask` are real) of one pixel.
INLINE void store16(__m512i acc, const epi_args* e, int64_t c, const uint8_t* r, uint8_t* y,
                    __mmask16 mask) {
  __m512i rlo = _mm512_setzero_si512(), rhi = rlo;
  if (e->res) {
    __m128i rb = _mm_maskz_loadu_epi8(mask, (const void*)r);
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
  _mm_mask_storeu_epi8((void*)y, mask, _mm512_cvtepi32_epi8(y32));
}

// The same requantize with 32-bit lanes where it is exact (pack_params: every acc + bias fits in
// i32, multipliers below 2^31, shifts >= 33). vpmuldq forms the 64-bit products of the even and
// of the odd channels (m0_odd holds the odd channels' multipliers in the even dwords it reads),
// and since floor shifts compose, (T + 2^(s-1)) >> s == ((T >> 32) + 2^(s-33)) >> (s-32): only
// the high halves of the sums T go on, as i32. The bias is already in the accumulator (the
// tile starts from it). The saturating store makes the clamps that the range of the output
// type implies.
INLINE void store16_narrow(__m512i v, const epi_args* e, int64_t c, const uint8_t* r,
                           uint8_t* y, __mmask16 mask) {
  __m512i pe = _mm512_mul_epi32(v, _mm512_loadu_si512((const void*)(e->m0_32 + c)));
  __m512i po = _mm512_mul_epi32(_mm512_srli_epi64(v, 32),
                                _mm512_loadu_si512((const void*)(e->m0_odd + c)));
  if (e->res) {
    __m128i rb = _mm_maskz_loadu_epi8(mask, (const void*)r);
    __m512i r32 = e->res_signed ? _mm512_cvtepi8_epi32(rb) : _mm512_cvtepu8_epi32(rb);
    r32 = _mm512_sub_epi32(r32, _mm512_set1_epi32(e->res_zp));
    pe = _mm512_add_epi64(pe, _mm512_mul_epi32(
        r32, _mm512_loadu_si512((const void*)(e->m1_32 + c))));
    po = _mm512_add_epi64(po, _mm512_mul_epi32(
        _mm512_srli_epi64(r32, 32), _mm512_loadu_si512((const void*)(e->m1_odd + c))));
  }
  __m512i t = _mm512_mask_blend_epi32((__mmask16)0xAAAA, _mm512_srli_epi64(pe, 32), po);
  t = _mm512_add_epi32(t, _mm512_loadu_si512((const void*)(e->round32 + c)));
  t = _mm512_srav_epi32(t, _mm512_loadu_si512((const void*)(e->sh32 + c)));
  if (!e->zfold) t = _mm512_add_epi32(t, _mm512_set1_epi32((int32_t)e->zout));
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

// Per-pixel and per-channel i32 terms added to the accumulators before the requantize (the
// zero-point corrections of a matmul whose operands are both run-time values); 0 for convs.
typedef struct {
  const int32_t* row;      // this tile's first pixel
  const int32_t* col;      // this image's channels (fp of them)
} terms_args;

INLINE void run_tile(const conv_args* a, const epi_args* e, const terms_args* t,
                     const uint8_t* const* xs, int64_t c0, int64_t f, const uint8_t* r,
                     uint8_t* const* ys, int MR, int NR) {
  __m512i acc[6][4];
  tile(a, xs, acc, MR, NR, e->narrow ? e->bias32 + c0 : 0);
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      int64_t c = c0 + 16 * j;
      int64_t left = f - c;
      // a matmul's blocks are 64 channels wide (packed at run time), so left can be <= 0
      __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF
                       : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
      __m512i v = acc[m][j];
      if (t) {
        v = _mm512_add_epi32(v, _mm512_set1_epi32(t->row[m]));
        v = _mm512_add_epi32(v, _mm512_loadu_si512((const void*)(t->col + c)));
      }
      if (e->fout)
        store16_float(v, e, c, r ? r + 4 * (m * f + 16 * j) : 0, ys[m] + 4 * 16 * j, mask);
      else if (e->narrow)
        store16_narrow(v, e, c, r ? r + m * f + 16 * j : 0, ys[m] + 16 * j, mask);
      else
        store16(v, e, c, r ? r + m * f + 16 * j : 0, ys[m] + 16 * j, mask);
    }
}

#define TILE_CASE(MR, NR) \
  case MR: run_tile(a, e, t, xs, c0, f, r, ys, MR, NR); break;
#define TILES(NR)                                                                         \
  static void tiles_##NR(const conv_args* a, const epi_args* e, const terms_args* t,      \
                         const uint8_t* const* xs, int64_t c0, int64_t f,                 \
                         const uint8_t* r, uint8_t* const* ys, int mr) {                  \
    switch (mr) {                                                                         \
      TILE_CASE(1, NR) TILE_CASE(2, NR) TILE_CASE(3, NR) TILE_CASE(4, NR)                 \
      TILE_CASE(5, NR) TILE_CASE(6, NR)                                                   \
    }                                                                                     \
  }
TILES(1)
TILES(2)
TILES(3)
TILES(4)

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
  a.row = wp * c;
  a.c = c; a.kh = kh; a.kw = kw; a.sw = h[H_SW]; a.dh = h[H_DH]; a.dw = h[H_DW];
  a.x = xb + xo + n * hp * wp * c;
  const int64_t k = kh * kw * c;
  const int64_t c0 = blk * 64;
  int64_t nr16 = (fp - c0) / 16;
  const int nr = nr16 > 4 ? 4 : (int)nr16;
  a.w = wb + wo + n * h[H_WSTRIDE] + c0 * k;
  epi_args e;
  const int64_t* per = h + HEADER;
  e.bias = per; e.m0 = per + fp; e.m1 = per + 2 * fp; e.add = per + 3 * fp;
  e.shift = per + 4 * fp;
  e.zout = h[H_ZOUT]; e.qmin = h[H_QMIN]; e.qmax = h[H_QMAX];
  e.res = (int)h[H_RES]; e.res_signed = (int)h[H_RES_SIGNED];
  e.narrow = (int)h[H_NARROW];
  e.res_zp = (int32_t)h[H_RES_ZP];
  e.sat_signed = (int)h[H_SIGNED];
  e.clamp_lo = (int)h[H_CLAMP_LO]; e.clamp_hi = (int)h[H_CLAMP_HI];
  e.zfold = (int)h[H_ZFOLD];        // the output zero point is in round32
  e.fout = (int)h[H_FLOAT];
  const int64_t esz = e.fout ? 4 : 1;     // bytes per output (and residual) element
  const int64_t* nt = per + 5 * fp;        // the narrow tables (pack_params)
  e.scale32 = (const float*)nt;            // a dequantize's 2^-sh (the narrow tables' place)
  e.bias32 = (const int32_t*)nt;
  e.m0_32 = e.bias32 + fp;
  e.m0_odd = e.m0_32 + fp;
  e.m1_32 = e.m0_odd + fp;
  e.m1_odd = e.m1_32 + fp;
  e.round32 = e.m1_odd + fp;
  e.sh32 = e.round32 + fp;
  const int64_t pixels = ohn * ow;
  const int64_t p0 = chunk * h[H_CHUNK];
  const int64_t p1 = p0 + h[H_CHUNK] < pixels ? p0 + h[H_CHUNK] : pixels;
  const int64_t image = n * pixels;              // the image's first output pixel
  // the output may be the next conv's padded input: H_YPT rows and H_YPL columns of border on
  // each side, filled with H_YFILL (the next conv's zero point) by the chunks they touch
  const int64_t pt = h[H_YPT], pl = h[H_YPL], owp = ow + 2 * pl;
  uint8_t* ybase = yb + (yo + n * (ohn + 2 * pt) * owp * f + c0) * esz;
  if (pt || pl) {
    const __m512i fill = _mm512_set1_epi8((char)h[H_YFILL]);
    const int64_t left = f - c0;
    const __mmask64 mask = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    const int64_t r0 = p0 / ow, r1 = (p1 - 1) / ow;   // output rows this chunk touches
    for (int64_t r = r0; r <= r1; ++r) {
      uint8_t* row = ybase + (r + pt) * owp * f;
      if (r * ow >= p0)                                   // the row starts in this chunk
        for (int64_t x = 0; x < pl; ++x) _mm512_mask_storeu_epi8(row + x * f, mask, fill);
      if (r * ow + ow <= p1)                              // the row ends in this chunk
        for (int64_t x = ow + pl; x < owp; ++x)
          _mm512_mask_storeu_epi8(row + x * f, mask, fill);
    }
    if (p0 == 0)
      for (int64_t x = 0; x < pt * owp; ++x) _mm512_mask_storeu_epi8(ybase + x * f, mask, fill);
    if (p1 == pixels)
      for (int64_t x = (ohn + pt) * owp; x < (ohn + 2 * pt) * owp; ++x)
        _mm512_mask_storeu_epi8(ybase + x * f, mask, fill);
  }
  terms_args tt;
  const terms_args* t = 0;
  if (terms) {
    tt.col = terms + h[H_N] * pixels + n * fp;
    t = &tt;
  }
  const int64_t sh_row = h[H_SH] * a.row, sw_c = a.sw * c;
  int64_t oy = p0 / ow, ox = p0 % ow;    // the next pixel's output row and column
  for (int64_t p = p0; p < p1; p += 6) {
    int mr = p1 - p >= 6 ? 6 : (int)(p1 - p);
    const uint8_t* xs[6];
    uint8_t* ys[6];
#pragma GCC unroll 6
    for (int m = 0; m < 6; ++m) {
      if (m < mr) {
        xs[m] = a.x + oy * sh_row + ox * sw_c;
        ys[m] = ybase + ((oy + pt) * owp + ox + pl) * f * esz;
        if (++ox == ow) { ox = 0; ++oy; }
      } else {
        xs[m] = a.x;
        ys[m] = ybase;
      }
    }
    const uint8_t* rp = e.res ? rb + (ro + (image + p) * f + c0) * esz : 0;
    if (terms) tt.row = terms + image + p;
    switch (nr) {
      case 1: tiles_1(&a, &e, t, xs, c0, f, rp, ys, mr); break;
      case 2: tiles_2(&a, &e, t, xs, c0, f, rp, ys, mr); break;
      case 3: tiles_3(&a, &e, t, xs, c0, f, rp, ys, mr); break;
      default: tiles_4(&a, &e, t, xs, c0, f, rp, ys, mr); break;
    }
  }
}

void qk_conv2d_u8s8(const uint8_t* xb, int64_t xo, const int8_t* wb, int64_t wo,
                    const int64_t* pb, int64_t po, const uint8_t* rb, int64_t ro,
                    uint8_t* yb, int64_t yo, int64_t blk, int64_t chunk, int64_t n) {
  conv_chunk(xb, xo, wb, wo, pb, po, rb, ro, 0, yb, yo, blk, chunk, n);
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
// Q_ROWS input rows of image n (and the border rows next to them).
enum { Q_N, Q_C, Q_H, Q_W, Q_PT, Q_PL, Q_ZP, Q_QMIN, Q_QMAX, Q_INV, Q_FILL, Q_ROWS };

static void quantize_row(const float* x, int64_t plane, int64_t w, int64_t c, __m512 inv,
                         __m512 zp, __m512 lo, __m512 hi, __m512i fill, uint32_t* y) {
  for (int64_t i = 0; i < w; i += 16) {
    const __mmask16 m = w - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (w - i)) - 1u);
    __m512i px = fill;
    for (int64_t ch = 0; ch < c; ++ch) {
      __m512 v = _mm512_maskz_loadu_ps(m, x + ch * plane + i);
      v = _mm512_roundscale_ps(_mm512_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, zp), lo), hi);
      const __m512i q = _mm512_cvttps_epi32(v);
      const __m512i keep = _mm512_set1_epi32(~(0xFF << (8 * ch)));
      px = _mm512_or_si512(_mm512_and_si512(px, keep), _mm512_slli_epi32(q, (unsigned)(8 * ch)));
    }
    _mm512_mask_storeu_epi32((void*)(y + i), m, px);
  }
}

void qk_quantize_nchw(const float* xb, int64_t xo, const int64_t* pb, int64_t po, uint8_t* yb,
                      int64_t yo, int64_t chunk, int64_t unused, int64_t n) {
  (void)unused;
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
  uint32_t* y = (uint32_t*)(yb + yo) + n * hp * wp;
  const int64_t r0 = chunk * h[Q_ROWS];
  const int64_t r1 = r0 + h[Q_ROWS] < hh ? r0 + h[Q_ROWS] : hh;
  // border rows: the top ones with the first chunk, the bottom ones with the last
  const int64_t b0 = r0 == 0 ? 0 : r0 + pt, b1 = r1 == hh ? hp : r1 + pt;
  for (int64_t r = b0; r < b1; ++r) {
    uint32_t* row = y + r * wp;
    if (r < pt || r >= hh + pt) {
      for (int64_t i = 0; i < wp; ++i) row[i] = fill;
      continue;
    }
    for (int64_t i = 0; i < pl; ++i) row[i] = row[pl + w + i] = fill;
    quantize_row(x + (r - pt) * w, hh * w, w, c, vinv, zp, lo, hi, vfill, row + pl);
  }
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
