"""A hand-written AVX-512 VNNI implicit-GEMM convolution microkernel (``conv_vnni.c``), linked
into IREE's executables through ``hal.executable`` objects.

* :func:`build_object` compiles the C source with gcc (cached by source and flag hash).
* :func:`pack_weights` lays the s8 weights out for the kernel; :func:`pack_params` writes the
  shape header and the per-channel requantize tables (i64).
* :func:`executable_mlir` is the ``hal.executable`` that calls the kernel: a workgroup grid of
  (64-channel blocks, chunks of output pixels, batch).

The kernel reads u8 NHWC input already padded by its zero point (the caller's pad also rounds
the channels up to a multiple of 4; those weights are zero), and writes the requantized int8
output (NHWC) directly: no im2col buffer and no activation packing.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qcompile.errors import CompileError

SOURCE = Path(__file__).with_name("conv_vnni.c")
SYMBOL = "qk_conv2d_u8s8"
MATMUL_SYMBOL = "qk_matmul_u8s8"
QUANT_SYMBOL = "qk_quantize_nchw"
MULTI_SYMBOL = "qk_linear_multi"
ATTN_SYMBOL = "qk_attention_u8"
DW_SYMBOL = "qk_dwconv_u8s8"
WINO_SYMBOL = "qk_wino_u8s8"
CTX_SIZE = 4         # i64 operand of a pooled dispatch: qk_pool_run, the pool, 0, 0
M_ENTRY = 4          # directory entry of a multi-linear call: first block, params, weights, out
BASE_CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni",
               "-fPIC", "-ffreestanding", "-fno-stack-protector", "-fno-strict-aliasing",
               "-fno-asynchronous-unwind-tables", "-c")


def cflags() -> tuple[str, ...]:
    """gcc's flags for the kernel object: AVX-512 VNNI, and VBMI where this host has it (the
    epilogue's table lookups; an artifact only runs on the host CPU it was compiled for)."""
    return BASE_CFLAGS + (("-mavx512vbmi",) if host_has_vbmi() else ())


HEADER = 37
H_NARROW = 24       # header slot: the narrow (32-bit lane) epilogue's split k (0: i64 lanes)
H_ZFOLD = 29        # header slot: the output zero point is folded into its rounding term
H_FLOAT = 30        # header slot: a dequantize (f32 out, f32 residual)
H_LUT = 31          # header slot: a 256-entry table applied to the requantized codes
BLOCK = 64          # output channels per workgroup
WINO_CHUNK = 12     # 4x4-pixel tiles per workgroup of the Winograd entry (two groups of 6)


def cache_dir() -> Path:
    root = os.environ.get("QCOMPILE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qcompile")
    return Path(root) / "ukernel"


def build_object() -> Path:
    """The kernel's object file, compiled by gcc once per source/flags (CompileError without
    gcc)."""
    return gcc_build(SOURCE, cflags(), "conv_vnni-{key}.o", "the VNNI conv microkernel",
                     "the stock lowering is used otherwise")


def driver_library(source: Path, driver: str, out_dir: Path,
                   flags: tuple[str, ...] | None = None) -> Path:
    """A shared library of ``source`` (the kernel: its object compiled once per source and
    flags into :func:`cache_dir`, the same object :func:`build_object` gives for the shipped
    source on this host) linked with ``driver`` (a small C driver, compiled each time) in
    ``out_dir``: what the kernel benches and their tests call through ctypes. ``flags``:
    gcc's, default :func:`cflags`."""
    flags = tuple(flags or cflags())
    obj = gcc_build(source, flags, f"{source.stem}-{{key}}.o", f"{source.name} (bench)",
                    "the kernel benches cannot run")
    drv = out_dir / f"driver-{hashlib.sha256(driver.encode()).hexdigest()[:12]}.c"
    drv.write_text(driver)
    so = out_dir / f"{obj.stem}-{drv.stem}.so"
    link = [f for f in flags if f != "-c"]
    proc = subprocess.run([_gcc(), *link, "-shared", str(obj), str(drv), "-o", str(so)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CompileError(f"cpu: gcc failed on the driver of {source.name}",
                           why=proc.stderr[-2000:], next="check the driver source")
    return so


def _gcc() -> str | None:
    """The C compiler: ``QCOMPILE_CC`` or gcc, resolved on PATH (None when absent)."""
    return shutil.which(os.environ.get("QCOMPILE_CC", "gcc"))


def gcc_build(source: Path, flags: tuple[str, ...], name: str, what: str, without: str) -> Path:
    """``source`` compiled by gcc (``QCOMPILE_CC``) with ``flags`` into :func:`cache_dir` as
    ``name`` (``{key}``: a hash of the source, compiler and flags), once; CompileError naming
    ``what`` without gcc (``without``: what happens then) or when gcc fails."""
    gcc = _gcc()
    if gcc is None:
        raise CompileError(f"cpu: {what} needs gcc", why="gcc not found on PATH",
                           next=f"install gcc or set QCOMPILE_CC ({without})")
    src = source.read_bytes()
    key = hashlib.sha256(src + " ".join((gcc, *flags)).encode()).hexdigest()[:16]
    out = cache_dir() / name.format(key=key)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qcompile-uk-") as tmp:
        obj = Path(tmp) / out.name
        proc = subprocess.run([gcc, *flags, str(source), "-o", str(obj)], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            raise CompileError(f"cpu: gcc failed on {what}", why=proc.stderr[-2000:],
                               next="check the gcc installation")
        os.replace(obj, out)
    return out


@functools.cache
def _cpuinfo() -> str:
    """/proc/cpuinfo's text, read once ("" where it cannot be read): the host checks below."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def host_has_vnni() -> bool:
    flags = _cpuinfo()
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl",
                                    "avx512_vnni"))


@dataclass(frozen=True)
class ConvShape:
    n: int
    hp: int              # padded input height
    wp: int              # padded input width
    c: int               # input channels, padded to a multiple of 4
    f: int               # output channels
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    oh: int
    ow: int
    wstride: int = 0     # bytes between the packed weights of two images (0: shared weights)
    f_round: int = 16    # output channels padded to a multiple of this (64: uniform blocks)
    out_pad: tuple[int, int] = (0, 0)   # output border rows / columns per side
    out_fill: int = 0                   # the border's value (u8 code)
    depthwise: bool = False             # one filter per channel (qk_dwconv_u8s8), c == f
    # the input's first element inside the buffer (elements): a conv without padding reading
    # another conv's padded output in place, hp x wp then that buffer's
    x_off: int = 0
    res_pad: tuple[int, int] = (0, 0)   # the residual's border rows / columns per side
    # packed rows (0: off): the input holds ``xstep`` bytes per pixel, unpadded, and the conv
    # runs as one column (kw 1) over ``c = padded_channels(KW * xstep)`` bytes of each kernel
    # row (:func:`packed_stem`)
    xstep: int = 0
    # pixel pairs (:func:`pairs_fit`): F = 8 or 24 output channels computed two pixels at a
    # time as 2F "virtual" channels (the first pixel's F, then the second's), so that no vector
    # is half empty; weights and per-channel tables are packed for the 2F
    pair: bool = False
    # Winograd F(4x4, 3x3) (:func:`wino_fits`, qk_wino_u8s8): a 3x3 stride-1 conv whose
    # workgroups take WINO_CHUNK tiles of 4x4 output pixels each, its weights packed by
    # :func:`pack_wino_weights`
    wino: bool = False

    @property
    def in_size(self) -> int:
        """Elements of the input buffer (border included; packed rows: and the slack the last
        window reads past the end)."""
        if self.xstep:
            return self.n * self.hp * self.wp * self.xstep + PACKED_SLACK
        return self.n * self.hp * self.wp * self.c

    @property
    def out_size(self) -> int:
        """Elements of the output buffer (border included)."""
        pt, pl = self.out_pad
        return self.n * (self.oh + 2 * pt) * (self.ow + 2 * pl) * self.f

    @property
    def fp(self) -> int:
        if self.pair:
            return 2 * self.f
        return -(-self.f // self.f_round) * self.f_round

    @property
    def blocks(self) -> int:
        return -(-self.fp // BLOCK)

    @property
    def chunk(self) -> int:
        """Output pixels per workgroup (flattened over the output rows): about one row's
        worth, a multiple of the kernel's 6-pixel tile, so that a row whose width is no multiple
        of 6 does not end in a short tile; a depthwise conv's is two output rows."""
        if self.depthwise:
            return 2 * self.ow
        if self.wino:          # (Winograd: tiles of 4x4 pixels, two groups of 6)
            return WINO_CHUNK
        tile = 12 if self.pair else 6        # (pairs: 6 pairs a tile)
        return tile * -(-self.ow // tile)

    @property
    def chunks(self) -> int:
        # (Winograd: chunks of 4x4 tiles, the tiles of all images flattened over their bands of
        # 4 rows)
        if self.wino:
            return -(-self.n * -(-self.oh // 4) * -(-self.ow // 4) // self.chunk)
        return -(-self.oh * self.ow // self.chunk)

    @property
    def grid(self) -> tuple[int, int, int]:
        """The workgroups: (channel blocks, chunks, images); the Winograd entry's chunks span
        the images (third dimension 1)."""
        return self.blocks, self.chunks, 1 if self.wino else self.n


@dataclass(frozen=True)
class QuantizeShape:
    """The model input's quantize as a microkernel conv's padded input (``qk_quantize_nchw``):
    f32 ``[N, C, H, W]`` (C <= 4) to u8 ``[N, H + 2 PT, W + 2 PL, 4]``, or packed rows
    ``[N, H + 2 PT, W + 2 PL, C]`` (then :data:`PACKED_SLACK` bytes)."""

    n: int
    c: int
    h: int
    w: int
    pt: int
    pl: int
    rows: int = 8                    # input rows per workgroup
    packed: bool = False

    @property
    def out_size(self) -> int:
        pixels = self.n * (self.h + 2 * self.pt) * (self.w + 2 * self.pl)
        return pixels * self.c + PACKED_SLACK if self.packed else pixels * 4

    @property
    def chunks(self) -> int:
        return -(-self.h // self.rows)


def pack_quantize_params(q: QuantizeShape, scale: float, zp: int, qmin: int, qmax: int,
                         fill: int) -> np.ndarray:
    """``qk_quantize_nchw``'s header: the shape, ``1/scale`` as float32 bits (the same
    reciprocal as ``qmath.quantize_array``), the zero point, clamp and border fill."""
    inv = np.float32(1.0) / np.float32(scale)
    bits = int(np.asarray(inv, np.float32).view(np.int32))
    return np.asarray([q.n, q.c, q.h, q.w, q.pt, q.pl, zp, qmin, qmax, bits, fill, q.rows,
                       int(q.packed)], np.int64)


def padded_channels(c: int) -> int:
    return -(-c // 4) * 4


PACKED_SLACK = 64     # bytes after packed rows: a last window's quads read up to 3 bytes past
Q_MAX_W = 2048        # the widest input row the quantize packs (conv_vnni.c)


def packed_stem(c: int, kw: int, w: int, dilation: int) -> bool:
    """Whether a conv over the model input (``c`` channels, ``kw`` columns, ``w`` pixels wide)
    reads packed rows (:attr:`ConvShape.xstep`): when that takes fewer quads per kernel row
    than ``kw`` pixels of 4 bytes (a 7×7 conv over RGB: 6 instead of 7; 3×3 over one channel:
    1 instead of 3). The quantize packs with AVX-512 VBMI."""
    return (dilation == 1 and -(-kw * c // 4) < kw * (padded_channels(c) // 4)
            and w <= Q_MAX_W and host_has_vbmi())


def pairs_fit(f: int, depthwise: bool = False, speed: bool = True) -> bool:
    """Whether a conv of ``f`` output channels runs as pixel pairs (:attr:`ConvShape.pair`):
    F = 8 or 24, whose last 16-channel vector a pixel alone would fill half (a 24-channel
    projection then takes 3 vectors per two pixels instead of 4), on a host issuing one 512-bit
    ``vpdpbusd`` a cycle. Where it issues two (:func:`host_vnni_pipes`, Zen 5) the pairs' blend
    and buffered row ends cost more than the empty half (kernel alone, one thread, minimum of
    41, plain / pairs ms: 56x56x96 -> 24 batch 4 0.149 / 0.168, 56x56x144 -> 24 with residual
    batch 4 0.225 / 0.244, batch 1 0.056 / 0.060). ``speed`` False: the kernel's condition
    only."""
    return not depthwise and f in (8, 24) and (not speed or host_vnni_pipes() == 1)


def pack_weights(w: np.ndarray, pair: bool = False) -> np.ndarray:
    """``w[F, KH, KW, C]`` (s8, OHWI) → the kernel's layout: per block of 64 output channels
    ``[KH, KW, C/4, channels, 4]`` (channels padded to 16 and C to 4 with zeros). ``pair``: the
    2F virtual channels of pixel pairs (:attr:`ConvShape.pair`), the filters twice."""
    if pair:
        w = np.concatenate([w, w])
    f, kh, kw, c = w.shape
    cp, fp = padded_channels(c), -(-f // 16) * 16
    wz = np.zeros((fp, kh, kw, cp), np.int8)
    wz[:f, :, :, :c] = w
    parts = []
    for c0 in range(0, fp, BLOCK):
        blk = wz[c0:c0 + BLOCK].reshape(-1, kh, kw, cp // 4, 4)
        parts.append(np.ascontiguousarray(np.transpose(blk, (1, 2, 3, 0, 4))).reshape(-1))
    return np.concatenate(parts)


# Winograd F(4x4, 3x3) in integers (qk_wino_u8s8): G scaled row by row to integers (Gs = D G,
# D = diag(4, 6, 6, 24, 24, 1)); the kernel's Bᵀ and Asᵀ = 24 Aᵀ D⁻¹ are in conv_vnni.c
WINO_G = np.array([[1, 0, 0], [-1, -1, -1], [-1, 1, -1], [1, 2, 4], [1, -2, 4], [0, 0, 1]],
                  np.int64)
WINO_MAX_C = 256      # a block's transformed weights, 36 C 64 i16: 1.2 MB at 256
# transformed weight bytes per output pixel above which the weights' traffic (8x the direct
# kernel's) costs more than the Winograd sums save
WINO_MAX_WEIGHT_BYTES = 8192
WINO_Y_BITS = 25      # |Y| < 2^25: Y is recovered from 576 Y modulo 2^32


def wino_fits(s: ConvShape, w: np.ndarray, speed: bool = True) -> str | None:
    """Why the conv ``s`` with weights ``w[F, KH, KW, C]`` (s8) cannot run as Winograd F(4x4,
    3x3) (``qk_wino_u8s8``), None where it can: a 3x3 stride-1 conv without dilation over
    plain NHWC input whose padded C is a multiple of 32 (at most :data:`WINO_MAX_C`), on a host
    where :func:`host_vnni_pipes` says 1 (none where it says 2), and F a multiple of 64; with
    at most :data:`WINO_MAX_WEIGHT_BYTES` of transformed weights per output pixel of the call
    (the 14x14x256 convs at 24 KB per pixel at batch 1 keep the direct kernel: resnet18 batch 1
    4.63 ms direct, 4.35 with this bound, 4.93 with those too; at 6 KB in the batch-8 shards of
    4 they take it on a one-pipe host: resnet50 batch 8 2 % faster); and whose exact sums stay
    below 2^25 for every input (128 · Σ|w| per output channel: the kernel recovers Y from
    576 Y modulo 2^32).
    ``speed`` False: the kernel's conditions only (not the bounds of C and of the weight bytes
    per pixel, which are where it pays)."""
    if (s.kh, s.kw, s.sh, s.sw, s.dh, s.dw) != (3, 3, 1, 1, 1, 1):
        return "not a 3x3 stride-1 conv"
    if s.depthwise or s.pair or s.xstep or s.x_off:
        return "not a plain NHWC conv"
    if s.c % 32 or s.f % 64:
        return "C not a multiple of 32 or F of 64"
    # Where vpdpbusd issues twice a cycle (host_vnni_pipes: Zen 5) the direct kernel runs twice as
    # fast and Winograd does not pay in a model. Kernel alone with warm caches it still wins up to
    # C = 128 (one thread, minimum of 21, direct / Winograd ms: 28x28x128 -> 128 batch 1 0.263 /
    # 0.214; 56x56x64 -> 64 batch 4 with residual 1.217 / 0.976), but with the caches flushed before
    # each call, as a model's layers find their weights, it loses (resnet18's shard of 4, minimum of
    # 9: 56x56x64 -> 64 1.149 / 1.245, 28x28x128 -> 128 1.131 / 1.322; its transformed weights are
    # 8x the direct kernel's bytes). resnet18, same process, alternating windows, three runs of
    # 16-24 windows, Winograd / direct per-window ratio: batch 8 1.037, 0.991, 1.016; batch 1 1.109,
    # 1.022, 1.027; resnet50 batch 8 1.011, batch 1 0.997. At C = 256 a block's 1.2 MB of
    # transformed weights leave L2 even with warm caches (14x14x256 -> 256 batch 8 2.022 / 2.409).
    if speed and host_vnni_pipes() > 1:
        return "vpdpbusd issues twice a cycle on this host: the direct kernel is faster"
    if speed and s.c > WINO_MAX_C:
        return f"C above {WINO_MAX_C} (a block's transformed weights would not stay in L2)"
    per_pixel = 36 * s.c * s.fp * 2 / (s.n * s.oh * s.ow)
    if speed and per_pixel > WINO_MAX_WEIGHT_BYTES:
        return (f"too few output pixels for its transformed weights ({per_pixel:.0f} bytes "
                f"per pixel at batch {s.n})")
    if 128 * int(np.abs(w.astype(np.int64)).reshape(w.shape[0], -1).sum(1).max()) \
            >= 2**WINO_Y_BITS:
        return "weights too large for the exact recovery"
    return None


def pack_wino_weights(w: np.ndarray, c: int) -> np.ndarray:
    """``w[F, 3, 3, C]`` (s8) → ``qk_wino_u8s8``'s weights as bytes: per block of 64 output
    channels ``U = Gs g Gsᵀ`` as ``[36][c/2][64][2]`` i16 (``c`` the padded channels), then
    ``128 · Σ w`` per output channel (i32: the kernel's inputs are centered, ``u8 - 128``)."""
    f = w.shape[0]
    g = np.zeros((f, 3, 3, c), np.int64)
    g[..., :w.shape[3]] = w
    u = np.einsum("ai,fijc,bj->fcab", WINO_G, g, WINO_G).reshape(f, c // 2, 2, 36)
    blocks = [np.transpose(u[b:b + BLOCK], (3, 1, 0, 2)) for b in range(0, f, BLOCK)]
    packed = np.ascontiguousarray(np.stack(blocks)).astype(np.int16)
    corr = (128 * g.reshape(f, -1).sum(1)).astype(np.int32)
    return np.concatenate([packed.reshape(-1).view(np.int8), corr.view(np.int8)])


DW_MAX_KW = 9          # three tap groups of three per kernel row (qk_dwconv_u8s8)


def depthwise_fits(c: int, kw: int, stride: tuple[int, int], dilation: tuple[int, int]
                   ) -> str | None:
    """``None`` when ``qk_dwconv_u8s8`` computes a depthwise conv of ``c`` channels, ``kw``
    columns, ``stride`` and ``dilation`` on this host, else why not."""
    if not host_has_vbmi():
        return "depthwise conv: the host CPU has no AVX-512 VBMI (vpermt2b)"
    if c % 16:
        return f"depthwise conv of {c} channels (not a multiple of 16)"
    if stride[1] not in (1, 2) or tuple(dilation) != (1, 1):
        return f"depthwise conv with stride {tuple(stride)}, dilation {tuple(dilation)}"
    if kw > DW_MAX_KW:
        return f"depthwise conv {kw} columns wide (at most {DW_MAX_KW})"
    return None


def dw_copies(kw: int, stride: tuple[int, int]) -> int:
    """Copies of the packed depthwise weights ``qk_dwconv_u8s8`` reads per 16 channels: at
    stride 1 its two-row form's as packed, one byte up and, with two tap groups (KW 4 or 5),
    two bytes up; else the packed weights alone."""
    if tuple(stride) != (1, 1):
        return 1
    return 3 if -(-kw // 3) == 2 else 2


def pack_dw_weights(w: np.ndarray, stride: tuple[int, int] = (1, 1)) -> np.ndarray:
    """Depthwise ``w[C, KH, KW]`` (s8) → ``qk_dwconv_u8s8``'s layout: per 16 channels
    ``[V, KH, G, 16, 4]``, ``G = ceil(KW / 3)``: taps ``3g .. 3g + 2`` of a kernel row in the
    first three bytes of each channel's dword, the fourth byte zero; ``V`` copies
    (:func:`dw_copies`), copy ``v`` with each dword shifted ``v`` bytes up (the taps of a
    stride-1 pixel pair's later outputs)."""
    c, kh, kw = w.shape
    g = -(-kw // 3)
    cp = -(-c // 16) * 16
    wz = np.zeros((cp, kh, g, 4), np.int8)
    for t in range(kw):
        wz[:c, :, t // 3, t % 3] = w[:, :, t]
    copies = np.zeros((dw_copies(kw, stride), *wz.shape), np.int8)
    for v, cv in enumerate(copies):
        cv[..., v:] = wz[..., :4 - v]     # each dword v bytes up, as vpslld would
    blocks = copies.reshape(-1, cp // 16, 16, kh, g, 4).transpose(1, 0, 3, 4, 2, 5)
    return np.ascontiguousarray(blocks).reshape(-1)


def pack_params(s: ConvShape, bias: np.ndarray, m0: np.ndarray, shift: np.ndarray,
                zout: int, qmin: int, qmax: int, *, m1: np.ndarray | None = None,
                res_zp: int = 0, res_signed: bool = False,
                acc_bound: int | None = None,
                dequant_scale: np.ndarray | None = None,
                float_residual: bool = False, lut: np.ndarray | None = None,
                lut_lo: int = 0) -> np.ndarray:
    """Header + per-channel i64 tables ``bias, m0, m1, add, shift`` (length ``fp`` each), then
    the tables of the narrow epilogue (see :func:`narrow_epilogue`).

    ``dequant_scale`` (float32 ``2^-sh`` per channel) makes it a dequantize: f32 out
    ``float32((acc + bias) * m0) * 2^-sh`` (plus an f32 residual), ``m0`` the scale's 24-bit
    significand (``qmath.scale_fixed``); the f32 table takes the narrow tables' place.
    ``float_residual``: that f32 result plus an f32 residual operand. ``lut``: the 256-entry
    table of an elementwise op that reads the requantized codes (index ``code - lut_lo``), whose
    entries the kernel stores instead (GELU's after FFN in).

    ``bias`` includes every term that is added to the accumulator before ``m0`` (folded zero
    points, minus the requant's own zero point of the accumulator term). ``acc_bound`` bounds
    ``|accumulator|`` before ``bias`` (with a matmul's run-time zero-point terms); default: a
    u8 × s8 sum over the window."""
    fp = s.fp

    def chan(v: np.ndarray | int | float | None, fill: int = 0,
             dtype: type = np.int64) -> np.ndarray:
        """``v`` per channel, padded to ``fp`` with ``fill`` (pixel pairs: the tables of the
        2F virtual channels, the F twice)."""
        out = np.full(fp, fill, dtype)
        if v is not None:
            real = np.broadcast_to(np.asarray(v, dtype), (s.f,))
            out[:(2 if s.pair else 1) * s.f] = np.tile(real, 2) if s.pair else real
        return out

    shift_c = chan(shift, 1)
    m1_c = chan(m1)
    bias_c, m0_c = chan(bias), chan(m0)
    with np.errstate(over="ignore"):
        add = (np.left_shift(np.int64(1), shift_c - 1) - np.int64(res_zp) * m1_c).astype(np.int64)
    if acc_bound is None:
        acc_bound = s.kh * s.kw * (1 if s.depthwise else s.c) * 255 * 128
    floating = dequant_scale is not None
    real = slice(0, s.f)
    # the narrow epilogue's split k (0: the i64 form): the sums T >> k go on in i32 lanes
    k = 0 if floating else narrow_shift(bias_c[real], m0_c[real], m1_c[real], shift_c[real],
                                        acc_bound)
    narrow = k > 0
    # clamps the saturating narrow store does not make: s8 codes saturate to [-128, 127], u8
    # codes (qmax > 127) to [0, 255] once the negatives are clamped away
    signed = qmax <= 127
    clamp_lo = not (signed and qmin == -128)
    clamp_hi = qmax not in (127, 255)
    # the output zero point folds into the narrow rounding term (zp · 2^(s-k) is a multiple
    # of the remaining shift) where that term and |T >> k| still fit in i32
    sh_k = np.maximum(shift_c, k + 1)       # (the padding channels' shifts are never used)
    round32 = np.left_shift(np.int64(1), sh_k - 1 - k) if narrow else np.zeros(fp, np.int64)
    zfold = False
    if narrow:
        high = _t_bound(bias_c[real], m0_c[real], m1_c[real], acc_bound) >> k
        lift = [int(r) + (abs(int(zout)) << int(sh - k)) for r, sh in
                zip(round32[real], shift_c[real], strict=True)]
        zfold = high + 1 + max(lift) < 2**31
        if zfold:
            round32 = round32 + np.int64(zout) * np.left_shift(np.int64(1), sh_k - k)
    h = np.zeros(HEADER, np.int64)
    h[:] = [s.hp, s.wp, s.c, s.kh, s.kw, s.sh, s.sw, s.dh, s.dw, s.oh, s.ow, s.f, fp,
              int(m1 is not None or float_residual), int(res_signed), zout, qmin,
              qmax, s.n, s.wstride, s.chunk, *s.out_pad, s.out_fill, k, res_zp,
              int(signed), int(clamp_lo), int(clamp_hi), int(zfold), int(floating),
              int(lut is not None), s.x_off, *s.res_pad, s.xstep, int(s.pair)]
    # the narrow epilogue's tables (i32, fp each): bias; m0 and m1, each also shifted down by
    # one channel (the odd channels' multipliers in the even dwords that vpmuldq reads); the
    # rounding term 2^(s-1-k) (+ zp · 2^(s-k) where it folds); s - k. Zeros where the wide
    # epilogue runs
    i32 = lambda v: v.astype(np.int32).view(np.int64)  # noqa: E731
    odd = lambda v: np.append(v[1:], 0)  # noqa: E731
    if narrow:
        tables = [i32(bias_c), i32(m0_c), i32(odd(m0_c)), i32(m1_c), i32(odd(m1_c)),
                  i32(round32), i32(sh_k - k)]
    elif floating:
        p = chan(dequant_scale, 1, np.float32)
        tables = [p.view(np.int64), np.zeros(6 * fp // 2, np.int64)]
    else:
        tables = [np.zeros(7 * fp // 2, np.int64)]
    if lut is not None:
        entries = np.asarray(lut, np.int64).reshape(-1)
        assert entries.size == 256, "a table of every int8 code"
        tables += [np.asarray([lut_lo], np.int64), entries.astype(np.int32).view(np.int64),
                   (entries & 255).astype(np.uint8).view(np.int64)]
    return np.concatenate([h, bias_c, m0_c, m1_c, add, shift_c, *tables])


def _t_bound(bias: np.ndarray, m0: np.ndarray, m1: np.ndarray, acc_bound: int) -> int:
    """A bound of ``|T|``, ``T = (acc + bias) m0 + (r - z_r) m1`` (``|r - z_r| <= 255``)."""
    return ((acc_bound + int(np.max(np.abs(bias)))) * int(np.max(m0))
            + 256 * int(np.max(m1)))


def narrow_shift(bias: np.ndarray, m0: np.ndarray, m1: np.ndarray, shift: np.ndarray,
                 acc_bound: int) -> int:
    """The split ``k`` of the narrow epilogue, 0 where it cannot run (the i64 form does).

    32 where :func:`narrow_epilogue` holds (every shift at least 33). Otherwise (a residual
    term with a multiplier near 1 sets the shift to 30-31) ``k = min(shift) - 1``: since floor
    shifts compose, ``(T + 2^(s-1)) >> s == ((T >> k) + 2^(s-1-k)) >> (s - k)`` for ``k <
    s``, and the kernel forms ``T >> k`` from the 64-bit products of even and odd lanes. That
    needs ``|T >> k|`` plus the rounding term in i32 and ``s - k <= 31``."""
    if narrow_epilogue(bias, m0, m1, shift, acc_bound):
        return 32
    if bias.size == 0 or int(np.max(np.abs(bias))) + acc_bound >= 2**31 or \
            not (np.all((m0 >= 0) & (m0 < 2**31)) and np.all((m1 >= 0) & (m1 < 2**31))):
        return 0
    k = int(np.min(shift)) - 1
    if k < 1 or int(np.max(shift)) - k > 31:
        return 0
    fits = (_t_bound(bias, m0, m1, acc_bound) >> k) + 1 + (1 << (int(np.max(shift)) - 1 - k))
    return k if fits < 2**31 else 0


def narrow_epilogue(bias: np.ndarray, m0: np.ndarray, m1: np.ndarray, shift: np.ndarray,
                    acc_bound: int) -> bool:
    """Whether the kernel may requantize with 32-bit lanes and ``vpmuldq`` instead of i64 lanes
    (the same result): every ``accumulator + bias`` fits in i32, the multipliers are below
    2^31 and every shift is at least 33. The product sum ``T = (acc + bias) m0 + (r - z_r) m1``
    is then formed per 64-bit lane, and since floor shifts compose,
    ``(T + 2^(s-1)) >> s == ((T >> 32) + 2^(s-33)) >> (s - 32)``: only its high half goes on,
    in i32 (|T| < 2^62 + 2^40, so that half, its rounding term and the output zero point stay
    in i32)."""
    if bias.size == 0:
        return False
    return bool(int(np.max(np.abs(bias))) + acc_bound < 2**31
                and np.all((m0 >= 0) & (m0 < 2**31)) and np.all((m1 >= 0) & (m1 < 2**31))
                and np.all((shift >= 33) & (shift <= 62)))


_TARGETS: dict[tuple[str, ...], str] = {}
_PROBE = """func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
  %0 = arith.mulf %a, %a : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""


def host_target(flags: tuple[str, ...]) -> str:
    """The ``#hal.executable.target`` iree-compile derives from ``flags`` (cached per process).

    The kernel's variant must carry exactly this target: IREE links every executable of one
    target into one variant, and a variant with another target becomes a second variant of the
    same format, which the runtime may pick for the stock dispatches (and not find them)."""
    if flags in _TARGETS:
        return _TARGETS[flags]
    from qcompile.codegen import iree_cpu

    with tempfile.TemporaryDirectory(prefix="qcompile-uk-") as tmp:
        src, out = Path(tmp) / "p.mlir", Path(tmp) / "p.out.mlir"
        src.write_text(_PROBE, encoding="utf-8")
        proc = iree_cpu._run([iree_cpu.iree_compile_path(), str(src), "-o", str(out),
                              "--compile-to=executable-sources", *flags])
        # an interrupted iree-compile can exit 0 having removed its output (its SIGINT handler)
        text = out.read_text(encoding="utf-8") if proc.returncode == 0 and out.exists() else ""
    m = re.search(r"hal\.executable\.variant public @\w+ target\((<.*?>)\)", text)
    if m is None:
        raise CompileError("cpu: cannot read the host executable target from iree-compile",
                           why=proc.stderr[-1000:])
    _TARGETS[flags] = m.group(1)
    return m.group(1)


def executable_mlir(name: str, obj: Path, s: ConvShape, nparams: int, nweights: int,
                    residual: bool, target: str, entry: str = "conv", matmul: bool = False,
                    floating: bool = False, pooled: bool = False) -> str:
    """A ``hal.executable`` @name, variant @x86, export @entry: bindings (x, w, params[, res],
    y), or for a batched ``matmul`` (x, w, params, terms, y) with the i32 zero-point terms
    (per pixel, then per channel, of every image); ``floating``: a dequantize, y and res f32.
    Executables of one module need distinct entries (they are linked into one library)."""
    et = "f32" if floating else "i8"
    ins = [("i8", s.in_size), ("i8", nweights), ("i64", nparams)]
    if matmul:
        ins.append(("i32", s.n * (s.oh * s.ow + s.fp)))
    elif residual:
        ins.append((et, s.n * s.oh * s.ow * s.f))
    order = [0, 1, 2, 3 if residual or matmul else 0, len(ins)]
    symbol = (MATMUL_SYMBOL if matmul else DW_SYMBOL if s.depthwise else WINO_SYMBOL if s.wino
              else SYMBOL)
    return _executable(name, obj, ins, (et, s.out_size), order, symbol,
                       s.grid, target, entry, pooled)


def quantize_executable_mlir(name: str, obj: Path, q: QuantizeShape, nparams: int, target: str,
                             entry: str, pooled: bool = False) -> str:
    """The ``hal.executable`` of :data:`QUANT_SYMBOL`: bindings (x f32, params, y), workgroups
    (row chunks, 1, N)."""
    ins = [("f32", q.n * q.c * q.h * q.w), ("i64", nparams)]
    return _executable(name, obj, ins, ("i8", q.out_size), [0, 1, 2], QUANT_SYMBOL,
                       (q.chunks, 1, q.n), target, entry, pooled)


def multi_executable_mlir(name: str, obj: Path, s: ConvShape, nweights: int, nparams: int,
                          out_size: int, blocks: int, target: str, entry: str,
                          pooled: bool = False) -> str:
    """The ``hal.executable`` of :data:`MULTI_SYMBOL` (linears sharing the input ``s``):
    bindings (x, w, params, y), workgroups (the linears' blocks, chunks, N)."""
    ins = [("i8", s.n * s.hp * s.wp * s.c), ("i8", nweights), ("i64", nparams)]
    return _executable(name, obj, ins, ("i8", out_size), [0, 1, 2, 3], MULTI_SYMBOL,
                       (blocks, s.chunks, s.n), target, entry, pooled)


# fused attention (qk_attention_u8): header slots, and the limits of its stack buffers
ATTN_HEADER = 40
ATTN_MAX_S = 512                 # keys (and queries) per sequence
ATTN_MAX_SD = 16384              # keys padded to 16 times the head size
ATTN_MAX_D = 128


@dataclass(frozen=True)
class AttentionShape:
    """One fused attention (``qk_attention_u8``): ``n`` images of ``s`` tokens, ``heads`` heads
    of ``d`` columns; q, k, v and the output are ``[n, s, heads · d]`` rows."""

    n: int
    s: int
    heads: int
    d: int
    mask_n: int                  # the mask's images (1: shared, n: one row each; 0: no mask)

    @property
    def rows(self) -> int:
        """Query rows per workgroup: every row of a head when the grid already has 8 heads
        to share out, else fewer (K and V are packed again by each workgroup of a head)."""
        split = max(1, -(-8 // (self.n * self.heads)))
        return -(-self.s // split)

    @property
    def chunks(self) -> int:
        return -(-self.s // self.rows)

    @property
    def size(self) -> int:
        return self.n * self.s * self.heads * self.d


def attention_fits(s: int, d: int) -> str | None:
    """``None`` when the kernel's stack buffers hold a head of ``s`` keys of ``d`` columns,
    else why not."""
    if d % 4 or d > ATTN_MAX_D:
        return f"head size {d} is not a multiple of 4 up to {ATTN_MAX_D}"
    if s > ATTN_MAX_S or (-(-s // 16) * 16) * (-(-d // 16) * 16) > ATTN_MAX_SD:
        return f"{s} keys of {d} columns exceed the kernel's stack buffers"
    return None


def pack_attention_params(a: AttentionShape, flips: tuple[bool, bool, bool],
                          zps: tuple[int, int, int, int], mask_lo: int,
                          rq1: tuple[int, ...], softmax: tuple[int, ...], rq2: tuple[int, ...],
                          mask_table: np.ndarray | None, exp_table: np.ndarray, *,
                          scores_signed: bool = False, vbmi: bool | None = None) -> np.ndarray:
    """``qk_attention_u8``'s params: the header (shape, operand flips to u8 q / s8 k, v, the
    zero points after them, the scores' requantize ``(bias, m, shift, zp, lo, hi)``, the
    softmax ``(M, zp, lo, hi)`` and the output requantize), then the mask table ``[4, 256]``
    and the softmax's exp table ``[256]`` as i32, then the same as bytes for hosts with
    AVX-512 VBMI (``vbmi``, default: this host): the mask table's codes and the exp table's
    three byte planes. Without a mask, row 2 (mask 1) of an identity table is read.
    ``scores_signed``: the softmax's input codes are s8."""
    ld = a.heads * a.d

    def narrow(rq: tuple[int, ...], terms: int) -> int:
        """The requantize ``(bias, m, shift, ...)`` in 32-bit lanes (:func:`narrow_epilogue`),
        its accumulator a sum of ``terms`` products of two centred int8 codes."""
        one = lambda x: np.asarray([x], np.int64)  # noqa: E731
        return int(narrow_epilogue(one(rq[0]), one(rq[1]), one(0), one(rq[2]),
                                   terms * 255 * 255))

    h = np.zeros(ATTN_HEADER, np.int64)
    h[:38] = [a.s, a.heads, a.d, ld, ld, ld, ld, a.rows, *map(int, flips), *zps,
              int(mask_table is not None), a.mask_n, mask_lo, *rq1, *softmax, *rq2,
              narrow(rq1, a.d), narrow(rq2, a.s),
              int(host_has_vbmi() if vbmi is None else vbmi), int(scores_signed)]
    if mask_table is None:
        mask_table = np.tile(np.arange(256, dtype=np.int64) + mask_lo, (4, 1))
    mt = np.asarray(mask_table, np.int64).reshape(-1)
    et = np.asarray(exp_table, np.int64).reshape(-1)
    tables = np.concatenate([mt, et]).astype(np.int32)
    planes = [(et >> (8 * i)) & 255 for i in range(3)]
    as_bytes = np.concatenate([mt & 255, *planes]).astype(np.uint8)
    return np.concatenate([h, tables.view(np.int64), as_bytes.view(np.int64)])


def host_vnni_pipes() -> int:
    """512-bit ``vpdpbusd`` this host issues per cycle (:func:`vnni_pipes` of /proc/cpuinfo)."""
    return vnni_pipes(_cpuinfo())


def vnni_pipes(cpuinfo: str) -> int:
    """512-bit ``vpdpbusd`` per cycle of the CPU that ``cpuinfo`` (/proc/cpuinfo's text)
    describes: 2 on AMD family 1Ah and later (Zen 5: 512-bit vector pipes; measured 1.84 a
    cycle by ``scripts/vnni_port_bench.py``), else 1 (Zen 4 splits a 512-bit op over two
    cycles: 1.0 a cycle; other CPUs are taken as one pipe, the choices tuned there)."""
    first = cpuinfo.split("\n\n", 1)[0]               # the first processor's lines
    fields = {k.strip(): v.strip() for k, _, v in
              (line.partition(":") for line in first.splitlines())}
    try:
        family = int(fields.get("cpu family", "0"))
    except ValueError:
        return 1
    return 2 if fields.get("vendor_id") == "AuthenticAMD" and family >= 0x1A else 1


def host_has_vbmi() -> bool:
    """Whether the host has AVX-512 VBMI (the attention kernel's byte-table lookups)."""
    return "avx512vbmi" in _cpuinfo().split()


def attention_executable_mlir(name: str, obj: Path, a: AttentionShape, nmask: int,
                              nparams: int, target: str, entry: str,
                              pooled: bool = False) -> str:
    """The ``hal.executable`` of :data:`ATTN_SYMBOL`: bindings (q, k, v, mask i64, params, y),
    workgroups (heads, row chunks, N)."""
    ins = [("i8", a.size), ("i8", a.size), ("i8", a.size), ("i64", nmask), ("i64", nparams)]
    return _executable(name, obj, ins, ("i8", a.size), [0, 1, 2, 3, 4, 5], ATTN_SYMBOL,
                       (a.heads, a.chunks, a.n), target, entry, pooled)


def _executable(name: str, obj: Path, ins: list[tuple[str, int]], out: tuple[str, int],
                order: list[int], symbol: str, grid: tuple[int, int, int], target: str,
                entry: str, pooled: bool = False) -> str:
    """A ``hal.executable`` whose one export calls ``symbol`` (bare pointers: each binding in
    ``order`` as pointer and element offset, then the workgroup ids) over ``grid``.

    ``pooled``: one workgroup that calls ``symbol``'s ``_par`` entry, which shares ``grid`` out
    over qcompile's thread pool; an extra last input binding holds the pool (:data:`CTX_SIZE`
    i64, see :mod:`qcompile.codegen.ukernel.pool`) and the grid is passed in place of the ids."""
    if pooled:
        order = [len(ins) + 1 if i == len(ins) else i for i in order] + [len(ins)]
        ins = [*ins, ("i64", CTX_SIZE)]
        symbol += "_par"
    binds = ", ".join(["#hal.pipeline.binding<storage_buffer, ReadOnly>"] * len(ins)
                      + ["#hal.pipeline.binding<storage_buffer>"])
    layout = f"#hal.pipeline.layout<bindings = [{binds}]>"
    lines = []
    args, types = [], []
    allb = [*ins, out]
    for i, (et, n) in enumerate(allb):
        lines.append(f"          %b{i} = hal.interface.binding.subspan layout({layout}) "
                     f"binding({i}) alignment(64) offset(%c0) : memref<{n}x{et}>")
        lines.append(f"          %p{i}, %o{i}, %z{i}, %s{i} = iree_codegen.extract_strided_"
                     f"metadata %b{i} : memref<{n}x{et}> -> memref<{et}>, index, index, index")
    for i in order:
        args += [f"%p{i}", f"%o{i}"]
        types += [f"memref<{allb[i][0]}>", "index"]
    if pooled:
        lines += [f"          %g{k} = arith.constant {g} : index" for k, g in enumerate(grid)]
        args += ["%g0", "%g1", "%g2"]
        grid = (1, 1, 1)
    else:
        args += ["%wx", "%wy", "%wz"]
    types += ["index"] * 3
    decl = ", ".join(f"%a{i}: {t}" for i, t in enumerate(types))
    body = "\n".join(lines)
    return f"""
  hal.executable private @{name} {{
    hal.executable.variant public @x86 target({target})
        objects([#hal.executable.object<{{path = "{obj}"}}>]) {{
      hal.executable.export public @{entry} ordinal(0) layout({layout})
          count(%device: !hal.device) -> (index, index, index) {{
        %x = arith.constant {grid[0]} : index
        %y = arith.constant {grid[1]} : index
        %z = arith.constant {grid[2]} : index
        hal.return %x, %y, %z : index, index, index
      }}
      builtin.module {{
        func.func private @{symbol}({decl}) attributes {{hal.import.static, llvm.bareptr = true}}
        func.func @{entry}() {{
          %c0 = arith.constant 0 : index
          %wx = hal.interface.workgroup.id[0] : index
          %wy = hal.interface.workgroup.id[1] : index
          %wz = hal.interface.workgroup.id[2] : index
{body}
          func.call @{symbol}({", ".join(args)}) : ({", ".join(types)}) -> ()
          return
        }}
      }}
    }}
  }}
"""
