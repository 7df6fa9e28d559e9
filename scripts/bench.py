#!/usr/bin/env python
"""The whole benchmark suite: `qcompile bench` on each CNN recipe (and the MLP and BERT encoder),
one after the other in this process' machine; writes out/bench/<recipe>/bench.{json,md,png} and
out/bench/summary.md.

Usage: .venv/bin/python scripts/bench.py [--recipes resnet18 mobilenet_v2 ...] [--repeats N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from qcompile.bench.suite import CEILING_SPREAD, run_bench, write_bench
from qcompile.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["resnet18", "resnet50", "mobilenet_v2", "efficientnet_lite0", "mlp", "bert_encoder"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="*", default=DEFAULT)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench")
    args = ap.parse_args()
    lines = ["# qcompile benchmark suite", "",
             "`*`: the host was busy in that batch size's windows (the int8 ceiling probe moved "
             f"by more than {CEILING_SPREAD}×); rerun those.", "",
             "| recipe | batch | qcompile ms | best int8 peer | its ms | qcompile speedup | "
             "int8 ceiling GOPS |",
             "|---|---|---|---|---|---|---|"]
    for name in args.recipes:
        report = run_bench(load_recipe(ROOT / "recipes" / f"{name}.yaml"), repeats=args.repeats)
        write_bench(report, args.out / name)
        for row in report["batches"]:
            s = report["summary"].get(f"batch_{row['batch']}")
            if not s:
                continue
            lines.append(f"| {name} | {row['batch']} | {row['ms']['qcompile']['median']} | "
                         f"{s['best_int8_peer']} | {row['ms'][s['best_int8_peer']]['median']} | "
                         f"{s['speedup_vs_best_int8']}{'*' if row['host_unsteady'] else ''} | "
                         f"{row['int8_ceiling_gops']} |")
        print("\n".join(lines[-len(report['batches']):]), flush=True)
    (args.out / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'summary.md'}")


if __name__ == "__main__":
    main()
