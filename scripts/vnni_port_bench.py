#!/usr/bin/env python
"""Throughput of the AVX-512 instructions the int8 kernels are made of, alone and mixed, on this
CPU: the hardware ceiling of ``vpdpbusd`` (GOPS per core) and what the requantize epilogue takes
from it. Each mix is a loop of independent instructions in inline assembly (16 destination
registers, or 16 slots of a 4 KiB buffer for the stores, so no dependency chain limits it),
built by gcc and timed; the clock comes from a chain of dependent scalar adds (one per cycle).

Usage: .venv/bin/python scripts/vnni_port_bench.py [--iters N] [--cpus 0 1]

With several ``--cpus`` the loops run on all of them at once (the all-core ceiling)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# one AVX-512 instruction per name: destination %%zmmD, sources zmm30 / zmm31 (zmm29 holds the
# vpermd indices); a D of 0..15 gives independent destinations
OPS = {
    "vpdpbusd": "vpdpbusd %%zmm30, %%zmm31, %%zmmD",
    "vpmuldq": "vpmuldq %%zmm30, %%zmm31, %%zmmD",
    "vpaddd": "vpaddd %%zmm30, %%zmm31, %%zmmD",
    "vpsrlq": "vpsrlq $32, %%zmm31, %%zmmD",
    "vpsravd": "vpsravd %%zmm30, %%zmm31, %%zmmD",
    "vpshufd": "vpshufd $0xf5, %%zmm31, %%zmmD",
    "vpackssdw": "vpackssdw %%zmm30, %%zmm31, %%zmmD",
    "vpermd": "vpermd %%zmm31, %%zmm29, %%zmmD",
    "vpermt2b": "vpermt2b %%zmm30, %%zmm29, %%zmmD",
    "vpermb": "vpermb %%zmm31, %%zmm29, %%zmmD",
    "vpmovzxbd": "vpmovzxbd %%xmm31, %%zmmD",
    "vpsllq": "vpsllq $2, %%zmm31, %%zmmD",
    "vpmadd52luq": "vpmadd52luq %%zmm30, %%zmm31, %%zmmD",
    "vpaddsw": "vpaddsw %%zmm30, %%zmm31, %%zmmD",
    "vpackuswb": "vpackuswb %%zmm30, %%zmm31, %%zmmD",
    "vpshufd{k}": "vpshufd $0xf5, %%zmm31, %%zmmD%{%%k1%}",
    "vpmulld": "vpmulld %%zmm30, %%zmm31, %%zmmD",
    "vpshrdd": "vpshrdd $8, %%zmm30, %%zmm31, %%zmmD",
    "vmulps": "vmulps %%zmm30, %%zmm31, %%zmmD",
    "vfmadd231pd": "vfmadd231pd %%zmm30, %%zmm31, %%zmmD",
    "vcvtdq2ps": "vcvtdq2ps %%zmm31, %%zmmD",
    "vcvtdq2pd": "vcvtdq2pd %%ymm31, %%zmmD",
    "vcvtpd2dq": "vcvtpd2dq %{rd-sae%}, %%zmm31, %%ymmD",
    "vinserti64x4": "vinserti64x4 $1, %%ymm30, %%zmm31, %%zmmD",
    # stores into a 4 KiB buffer (%0), 64 bytes apart
    "store zmm": "vmovdqa64 %%zmm30, OFS(%0)",
    "store ymm": "vmovdqa64 %%ymm30, OFS(%0)",
    "store xmm": "vmovdqa64 %%xmm30, OFS(%0)",
    "store r64": "mov %0, OFS(%0)",
    # loads from the same buffer
    "load zmm": "vmovdqa64 OFS(%0), %%zmmD",
    "load ymm": "vmovdqa64 OFS(%0), %%ymmD",
    "vpbroadcastd (mem)": "vpbroadcastd OFS(%0), %%zmmD",
    "vpdpbusd (mem)": "vpdpbusd OFS(%0), %%zmm31, %%zmmD",
}


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


# the ops that need more than AVX-512 VNNI (the /proc/cpuinfo flag): timed only where the host
# has it (the flags read once)
NEEDS = {"vpermt2b": "avx512vbmi", "vpermb": "avx512vbmi", "vpmadd52luq": "avx512ifma",
         "vpshrdd": "avx512_vbmi2"}
_FLAGS = _cpu_flags()

# each op beside vpdpbusd, one to one: what it takes from the vpdpbusd pipe
PAIRED = ("vpmuldq", "vpaddd", "vpsrlq", "vpshufd", "vpackssdw", "vpsravd", "vpmovzxbd",
          "vpsllq", "vpermd", "vpermb", "vpermt2b", "vpmadd52luq", "vpshrdd", "vpaddsw",
          "vpackuswb", "vpshufd{k}", "vpmulld", "vmulps", "vfmadd231pd", "vcvtdq2ps",
          "vcvtdq2pd", "vcvtpd2dq", "vinserti64x4", "store zmm", "store ymm", "store xmm",
          "store r64", "load zmm", "vpbroadcastd (mem)")


def _has(op: str) -> bool:
    """Whether this host runs ``op`` (the ops in NEEDS only where /proc/cpuinfo lists theirs)."""
    return NEEDS.get(op, "avx512f") in _FLAGS


def _is_dp(op: str) -> bool:
    """Whether ``op`` is a vpdpbusd (register or memory operand)."""
    return op.startswith("vpdpbusd")


# (name, [(op, count), ...]): the instructions of one step, repeated; per 16 outputs where it
# models a kernel
MIXES: list[tuple[str, list[tuple[str, int]]]] = [
    *((op, [(op, 16)]) for op in OPS if _has(op)),
    *((f"vpdpbusd + {op}", [("vpdpbusd", 8), (op, 8)]) for op in PAIRED if _has(op)),
    # the weights as vpdpbusd's memory operand: one 512-bit load per vpdpbusd
    ("vpdpbusd (mem) + vpbroadcastd (mem)", [("vpdpbusd (mem)", 8), ("vpbroadcastd (mem)", 2)]),
    # the two shifts of the requantize share one pipe
    ("vpsrlq + vpsravd", [("vpsrlq", 8), ("vpsravd", 8)]),
    # the lean requantize of four vectors (64 outputs) and their byte pack, no sums: bound by
    # the two 512-bit operations a cycle the core issues, not by the vpdpbusd pipe
    ("lean epilogue (64 outputs)", [("vpmuldq", 8), ("vpsrlq", 4), ("vpshufd{k}", 4),
                                     ("vpaddd", 4), ("vpsravd", 4), ("vpackssdw", 2),
                                     ("vpackuswb", 1), ("vpermd", 1)]),
    # a 1x1 conv with K = 16 per 16 outputs: 4 vpdpbusd, then the exact requantize (odd lanes
    # down, two 32x32->64 products, high halves merged, rounding, shift) and a quarter of the
    # byte packs and their reorder
    ("K=16 conv step (16 outputs)", [("vpdpbusd", 4), ("vpsrlq", 1), ("vpmuldq", 2),
                                     ("vpshufd", 1), ("vpaddd", 1), ("vpsravd", 1)]),
    ("K=64 conv step (16 outputs)", [("vpdpbusd", 16), ("vpsrlq", 1), ("vpmuldq", 2),
                                     ("vpshufd", 1), ("vpaddd", 1), ("vpsravd", 1)]),
]

HEAD = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static char sink[4096] __attribute__((aligned(64)));
#define CLOBBER "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9", \
  "xmm10","xmm11","xmm12","xmm13","xmm14","xmm15"
int main(int argc, char** argv) {
  const long n = atol(argv[1]);
  if (argc > 2) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(atoi(argv[2]), &one);
    sched_setaffinity(0, sizeof one, &one);
  }
  double t, v, best;
  long x = 1;
  __asm__ volatile("vpternlogd $0xff, %%zmm29, %%zmm29, %%zmm29\n\tmovw $0x5555, %%ax\n\t"
                   "kmovw %%eax, %%k1" ::: "xmm29", "rax", "k1");
"""
# the clock: a chain of dependent scalar adds, one per cycle
CLOCK = ('__asm__ volatile("add %0, %0\\n\\tadd %0, %0\\n\\tadd %0, %0\\n\\tadd %0, %0\\n\\t'
         'add %0, %0\\n\\tadd %0, %0\\n\\tadd %0, %0\\n\\tadd %0, %0" : "+r"(x));')
# each loop is timed REPEATS times and its fastest pass kept (a pass the scheduler preempted
# would otherwise read as a slow instruction)
REPEATS = 5


def _timed(stmt: str, count: int, label: str) -> str:
    """C that runs ``stmt`` (``count`` instructions) n times, REPEATS times over, and prints
    ``label`` and the fastest pass's rate (G instructions / s)."""
    return (f'  best = 0;\n  for (int r = 0; r < {REPEATS}; ++r) {{\n    t = now();\n'
            f'    for (long i = 0; i < n; ++i) {stmt}\n'
            f'    v = n * {count}.0 / (now() - t) / 1e9;\n    best = v > best ? v : best;\n'
            f'  }}\n  printf("{label}%.6f\\n", best);')


def _body(mix: list[tuple[str, int]], repeat: int = 4) -> tuple[str, int]:
    """The mix's step ``repeat`` times as one asm string and its length: the accumulating
    vpdpbusd cycles over zmm0..7 (eight chains hide its latency), the rest over zmm8..15."""
    lines, acc, other = [], 0, 0
    for _ in range(repeat):
        for op, count in mix:
            for _ in range(count):
                if _is_dp(op):
                    d, acc = acc % 8, acc + 1
                else:
                    d, other = 8 + other % 8, other + 1
                lines.append(OPS[op].replace("mmD", f"mm{d}").replace("OFS", str(64 * d)))
    return "\\n\\t".join(lines), len(lines)


def source() -> str:
    out = [HEAD, _timed(CLOCK, 8, "clock ")]
    for name, mix in MIXES:
        body, count = _body(mix)
        out.append(_timed(f'__asm__ volatile("{body}" :: "r"(sink) : CLOBBER, "memory");',
                          count, f"{name}\\t"))
    out.append("  return (int)(x & 1) * 0;\n}\n")
    return "\n".join(out)


def run(iters: int, cpus: list[int]) -> list[dict[str, float]]:
    """Per CPU: the clock (GHz) and each mix's instructions per second (G/s)."""
    with tempfile.TemporaryDirectory(prefix="qcompile-ports-") as tmp:
        src, exe = Path(tmp) / "ports.c", Path(tmp) / "ports"
        src.write_text(source())
        subprocess.run(["gcc", "-O2", "-mavx512f", "-mavx512bw", "-mavx512vnni", str(src), "-o",
                        str(exe)], check=True)
        procs = [subprocess.Popen([str(exe), str(iters), str(c)], stdout=subprocess.PIPE,
                                  text=True) for c in cpus]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    rows = []
    for text in outs:
        row = {}
        for line in text.splitlines():
            name, _, value = line.rpartition("\t") if "\t" in line else line.partition(" ")
            row[name.strip()] = float(value)
        rows.append(row)
    return rows


def table(rows: list[dict[str, float]]) -> str:
    clock = min(r["clock"] for r in rows)
    lines = [f"clock {clock:.2f} GHz (dependent scalar adds), CPUs at once: {len(rows)}", "",
             "| mix | instructions / cycle | cycles per step | vpdpbusd GOPS per core |",
             "|---|---|---|---|"]
    for name, mix in MIXES:
        rate = min(r[name] for r in rows)                  # G instructions / s, slowest CPU
        steps = sum(c for _, c in mix)                     # instructions per step
        ipc = rate / clock
        dp = sum(c for op, c in mix if _is_dp(op))
        gops = rate * dp / steps * 128 if dp else 0.0      # 64 u8 x s8 MACs each
        lines.append(f"| {name} | {ipc:.2f} | {steps / ipc:.2f} | "
                     f"{f'{gops:.0f}' if dp else '-'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2_000_000,
                    help="loop iterations per mix (4 steps each)")
    ap.add_argument("--cpus", type=int, nargs="*", default=[0])
    args = ap.parse_args()
    print(table(run(args.iters, args.cpus)))


if __name__ == "__main__":
    sys.exit(main())
