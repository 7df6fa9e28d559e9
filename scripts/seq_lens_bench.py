#!/usr/bin/env python
"""A token model compiled at several sequence lengths (recipe ``model.seq_lens``) on target cpu:
median latency per compiled length at batch 1, and what padding to a longer compiled length does
to the outputs.

The recipe (default recipes/minilm.yaml) is quantized once with ``model.seq_lens`` set; a few
sentences and the first ``--texts`` of the evaluation split are tokenized at each length. For
every length ``L`` and every longer compiled length ``L'``, the same inputs run exactly at ``L``
and padded (id 0, mask 0) to ``L'``; the output gives the largest absolute difference (0.0:
padding changes nothing) and how many texts differ at all.

Usage: .venv/bin/python scripts/seq_lens_bench.py [--recipe R.yaml] [--lengths 16 32 64 128]
           [--repeats 30] [--texts 60] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from calibration.readers.sentences import load_sentences
from qcompile.bench.latency import median_ms
from qcompile.codegen.target import CompileOptions
from qcompile.frontend.quantize import QuantizeConfig, quantize
from qcompile.pipeline import build_model, calibration_batches
from qcompile.recipe import load_recipe, recipe_from_dict
from qcompile.runtime.artifact import cpu_model
from qcompile.targets import compile_quantized

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["A man is playing a guitar on the stage.", "The weather is lovely today.",
         "Quantization keeps matrix multiplications in eight-bit integers while the model "
         "stays accurate enough for retrieval.", "Dogs run."]


def padded_diffs(model: Any, tokenize: Any, lengths: list[int], texts: list[str]
                 ) -> list[dict[str, Any]]:
    """``texts`` tokenized at each ``L`` (truncated or padded to it), run at ``L`` and padded
    to each longer compiled length: the largest difference and how many texts differ at all."""
    rows = []
    runners = model.runner.runners
    for i, short in enumerate(lengths):
        x = tokenize(texts, short)
        exact = runners[short](*x)
        for long in lengths[i + 1:]:
            padded = runners[long](*[torch.nn.functional.pad(t, (0, long - short)) for t in x])
            diff = (exact - padded).abs().flatten(1).amax(1)
            rows.append({"length": short, "padded_to": long, "texts": len(texts),
                         "max_abs_diff": float(diff.max()),
                         "texts_that_differ": int((diff > 0).sum())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "minilm.yaml"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--texts", type=int, default=60, help="evaluation sentences padded")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = load_recipe(args.recipe)
    data = base.model_dump(exclude={"path"})
    data["model"]["seq_lens"] = args.lengths
    recipe = recipe_from_dict({k: v for k, v in data.items() if v is not None}, path=base.path)
    mut = build_model(recipe)
    t0 = time.perf_counter()
    q = quantize(mut.module, mut.example_inputs(), calibration_batches(recipe, mut),
                 QuantizeConfig.from_recipe(recipe))
    quantize_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = compile_quantized(q, "cpu", CompileOptions(batch_sizes=(1,), analyze=False))
    compile_s = time.perf_counter() - t0
    lengths = model.report["compile"]["seq_lens"]
    tokenize = mut.spec.tokenizer
    inputs = {str(n): tokenize(TEXTS[:1], n) for n in lengths}
    inputs[f"17 (runs at {min(n for n in lengths if n >= 17)})"] = tokenize(TEXTS[:1], 17)
    calls = {name: (lambda x=x: model(*x)) for name, x in inputs.items()}
    result = {"recipe": recipe.name, "host": f"{platform.machine()} {cpu_model()}",
              "seq_lens": lengths, "calibration_seq_len": model.runner.main,
              "quantize_s": round(quantize_s, 1), "compile_s": round(compile_s, 1),
              "compile_s_per_seq_len": model.report["seq_lens"]["compile_s_per_seq_len"],
              "latency_ms_batch1": median_ms(calls, repeats=args.repeats),
              "padding": padded_diffs(model, tokenize, lengths,
                                      TEXTS + load_sentences("evaluation")[:args.texts])}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
