#!/usr/bin/env python
"""Calibration methods compared: each recipe run once per `calibration.method`, on the same
calibration and evaluation data; writes <out>/calibration_compare.{json,md} and prints the table.

Every number comes from `qcompile.pipeline.run_recipe`: the accuracy of each target against the
float model, the recipe's threshold checks, and `timings_s.quantize_s` (export, prepare, observe
the calibration batches, convert: the observers are what differs between methods).

Usage: .venv/bin/python scripts/compare_calibration.py [--recipes R.yaml ...] [--methods M ...]
           [--targets reference pt2e] [--set calibration.batches=2 ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from calibration.methods import METHODS, check_method_options, method_options
from qcompile.pipeline import run_recipe
from qcompile.recipe import Recipe, load_recipe, recipe_from_dict
from qcompile.runtime.artifact import cpu_model

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RECIPES = [ROOT / "recipes" / "efficientnet_lite0.yaml", ROOT / "recipes" / "minilm.yaml"]
DEFAULT_TARGETS = ["reference", "pt2e"]
# compare metrics shown in the table when a row measured them (the JSON keeps all of them)
SHOWN = {"top1_agreement": "top-1 agr.", "sqnr_db": "SQNR dB", "cosine": "cosine",
         "cosine_min": "min cosine"}


def variant(recipe: Recipe, method: str, overrides: dict[str, Any] | None = None) -> Recipe:
    """``recipe`` with ``calibration.method`` set to ``method`` (and dotted-key ``overrides``),
    validated like a file. The recipe's ``method_options`` belong to its own method: another
    method runs with its defaults. An unknown method is a :class:`RecipeError`."""
    check_method_options(method, {})
    data = copy.deepcopy(recipe.model_dump())
    if data["calibration"]["method"] != method:
        data["calibration"]["method_options"] = {}
    data["calibration"]["method"] = method
    for key, value in (overrides or {}).items():
        _set(data, key, value)
    return recipe_from_dict(data, path=f"{recipe.path} [calibration.method={method}]")


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value


def row(recipe: Recipe, report: dict[str, Any]) -> dict[str, Any]:
    """One method's line: what it calibrated on, how long quantizing took, each target's
    accuracy and threshold checks."""
    c = recipe.calibration
    calib = report["quantization"]["calibration"]
    return {
        "recipe": recipe.name,
        "model": report["model"]["name"],
        "method": calib["method"],
        "method_options": {**method_options(c.method), **c.method_options},
        "calibration": {k: calib[k] for k in ("dataset", "batches", "samples")},
        "evaluation_samples": report["evaluation"]["samples"],
        "quantize_s": report["timings_s"]["quantize_s"],
        "targets": {name: _target(t) for name, t in report["targets"].items()},
    }


def _target(t: dict[str, Any]) -> dict[str, Any]:
    if t.get("status") != "ok":
        return {"status": t.get("status"), "reason": t.get("reason"), "passed": False}
    a = t["accuracy"]
    return {"status": "ok", "compare": a["compare"], "float": a["float"], "int8": a["int8"],
            "checks": a["checks"], "passed": a["passed"], "evaluate_s": t.get("evaluate_s")}


def compare(recipes: Sequence[str | Path] = DEFAULT_RECIPES,
            methods: Sequence[str] = METHODS, *, targets: Sequence[str] = DEFAULT_TARGETS,
            overrides: dict[str, Any] | None = None, out: str | Path | None = None,
            warmup: bool = True, echo: bool = False) -> dict[str, Any]:
    """Run every recipe once per method on ``targets``; returns the result (and writes
    ``calibration_compare.{json,md}`` into ``out`` after every run, so a long comparison that
    is interrupted keeps what it measured). Every variant is validated before the first run;
    with ``warmup``, each model is quantized once untimed first, so the first method's
    ``quantize_s`` does not carry the process' first export."""
    variants = [(m, variant(load_recipe(p), m, overrides)) for p in recipes for m in methods]
    result = {"machine": machine(), "targets": list(targets), "overrides": overrides or {},
              "warmup_quantize_s": {}, "rows": []}
    for method, recipe in variants:
        if warmup and recipe.name not in result["warmup_quantize_s"]:
            result["warmup_quantize_s"][recipe.name] = warm_up(recipe)
        t0 = time.perf_counter()
        report = run_recipe(recipe, targets=list(targets))
        result["rows"].append({**row(recipe, report), "run_s": round(time.perf_counter() - t0, 1)})
        if echo:
            print(f"{recipe.name} {method}: {time.perf_counter() - t0:.0f} s", flush=True)
        if out is not None:
            write(result, Path(out))
    result["machine"]["load_end"] = _load()
    if out is not None:
        write(result, Path(out))
    return result


def warm_up(recipe: Recipe) -> float:
    """Quantize ``recipe``'s model once on one calibration batch with min-max (export, prepare,
    convert: what every method pays besides observing); returns the seconds it took."""
    from qcompile.frontend.quantize import QuantizeConfig, quantize
    from qcompile.pipeline import build_model, calibration_batches

    t0 = time.perf_counter()
    one = variant(recipe, "minmax", {"calibration.batches": 1})
    mut = build_model(one)
    quantize(mut.module, mut.example_inputs(), calibration_batches(one, mut),
             QuantizeConfig.from_recipe(one))
    return round(time.perf_counter() - t0, 2)


def machine() -> dict[str, Any]:
    from qcompile.pipeline import versions

    return {"date": time.strftime("%Y-%m-%d"), "host": platform.machine(),
            "processor": cpu_model(), "cpus": os.cpu_count(), "torch_threads": _threads(),
            "load_start": _load(), "versions": versions(), "commit": _commit()}


def _commit() -> str | None:
    """The checkout's HEAD, with ``+dirty`` when tracked files differ from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "-uno") else "") if head else None
    except (OSError, subprocess.SubprocessError):
        return None


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def markdown(result: dict[str, Any]) -> str:
    """One table per recipe: a line per method, per target its metrics and thresholds."""
    m = result["machine"]
    lines = ["# Calibration methods compared", "",
             f"{m['date']}, {m['processor']} ({m['cpus']} CPUs, torch threads "
             f"{m['torch_threads']}, load {m['load_start']} → {m.get('load_end')}); "
             f"torch {m['versions'].get('torch')}, torchao {m['versions'].get('torchao')}; "
             f"qcompile at {m.get('commit')}."]
    for name in dict.fromkeys(r["recipe"] for r in result["rows"]):
        lines += ["", *_table([r for r in result["rows"] if r["recipe"] == name])]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    first = rows[0]
    targets = list(first["targets"])
    cols = [(t, k) for t in targets for k in SHOWN
            if any(k in r["targets"][t].get("compare", {}) for r in rows)]
    tasks = [(t, k) for t in targets for k in dict.fromkeys(
        k for r in rows for k in r["targets"][t].get("int8", {}))]
    head = ["method", "quantize s", *(f"{t} {SHOWN[k]}" for t, k in cols),
            *(f"{t} int8 {k}" for t, k in tasks), *(f"{t} thresholds" for t in targets)]
    c = first["calibration"]
    floats = {k: v for t in targets for k, v in first["targets"][t].get("float", {}).items()}
    float_note = "".join(f"; float {k} {v:.4f}" for k, v in floats.items())
    lines = [f"**{first['recipe']}** ({first['model']}; calibration {c['dataset']}, "
             f"{c['batches']} batches / {c['samples']} samples; evaluation "
             f"{first['evaluation_samples']} samples{float_note})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ts = r["targets"]
        cells = [_method(r), f"{r['quantize_s']:.1f}",
                 *(_num(ts[t].get("compare", {}).get(k), k) for t, k in cols),
                 *(_num(ts[t].get("int8", {}).get(k), k) for t, k in tasks),
                 *(_verdict(ts[t]) for t in targets)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _method(r: dict[str, Any]) -> str:
    opts = ", ".join(f"{k}={v}" for k, v in r["method_options"].items())
    return f"{r['method']} ({opts})" if opts else r["method"]


def _num(value: float | None, key: str) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}" if key == "sqnr_db" else f"{value:.4f}"


def _verdict(t: dict[str, Any]) -> str:
    if t.get("status") != "ok":
        return f"{t.get('status')}"
    failed = [c["key"] for c in t["checks"] if not c["passed"]]
    return "pass" if not failed else "FAIL " + ", ".join(failed)


def write(result: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "calibration_compare.json", out / "calibration_compare.md"
    js.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    md.write_text(markdown(result), encoding="utf-8")
    return js, md


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY.PATH=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", type=Path, default=DEFAULT_RECIPES)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--targets", nargs="+", default=DEFAULT_TARGETS)
    ap.add_argument("--set", dest="overrides", action="append", type=_override, default=[],
                    metavar="KEY.PATH=VALUE", help="recipe override, e.g. calibration.batches=2")
    ap.add_argument("--out", type=Path, default=Path("calibration-compare"))
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the untimed first quantize of each model")
    args = ap.parse_args(argv)
    result = compare(args.recipes, args.methods, targets=args.targets,
                     overrides=dict(args.overrides), out=args.out, warmup=args.warmup,
                     echo=True)
    print(markdown(result), end="")
    print(f"wrote {args.out / 'calibration_compare.json'}, {args.out / 'calibration_compare.md'}")
    return result


if __name__ == "__main__":
    main()
