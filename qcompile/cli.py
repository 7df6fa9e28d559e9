"""The ``qcompile`` command line.

Every :class:`QCompileError` is printed as its message alone (what / at / why / next) and the
process exits with the error's code (2; 1 for failed accuracy checks). Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer

from qcompile.errors import AccuracyError, QCompileError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="qcompile: quantize a PyTorch model with PT2E and compile it to int8.")

RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML file, e.g. recipes/digits_cnn.yaml")]
TargetOpt = Annotated[list[str] | None, typer.Option(
    "--target", "-t", help="target to run (repeatable); default: the recipe's targets")]
OutOpt = Annotated[Path | None, typer.Option(
    "--out", "-o", help="output folder for report.json/report.md; default: out/<recipe name>")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="no progress bars")]


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except QCompileError as err:
            typer.echo(f"qcompile: error: {err}", err=True)
            raise typer.Exit(err.exit_code) from None

    return wrapper


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="qcompile: %(levelname)s: %(message)s")


def _run(recipe_path: Path, target: list[str] | None, out: Path | None,
         quiet: bool) -> dict[str, Any]:
    from qcompile.pipeline import run_recipe, write_outputs
    from qcompile.recipe import TARGETS, load_recipe

    recipe = load_recipe(recipe_path)
    for t in target or ():
        if t not in TARGETS:
            from qcompile.errors import RecipeError

            raise RecipeError(f"unknown target {t!r}", at="--target",
                              why=f"valid targets: {', '.join(TARGETS)}",
                              next="pass one of the valid targets")
    out_dir = out or Path("out") / recipe.name
    report = run_recipe(recipe, targets=target, progress=not quiet and sys.stderr.isatty(),
                        out_dir=out_dir)
    json_path, md_path = write_outputs(report, out_dir)
    _print_summary(report)
    typer.echo(f"wrote {json_path} and {md_path}")
    return report


def _print_summary(report: dict[str, Any]) -> None:
    for name, t in report["targets"].items():
        if t["status"] != "ok":
            typer.echo(f"{name:10} {t['status']}: {t.get('reason', '')}")
            continue
        a = t["accuracy"]
        c = a["compare"]
        extra = "".join(f", {k} float {a['float'][k]:.4f} int8 {a['int8'][k]:.4f}"
                        for k in a["int8"])
        typer.echo(f"{name:10} sqnr {c['sqnr_db']:.1f} dB, cosine {c['cosine']:.5f}"
                   + (f", top1 agreement {c['top1_agreement']:.4f}" if "top1_agreement" in c
                      else "") + extra + f"  [{'PASS' if a['passed'] else 'FAIL'}]")
        if "exactness" in t and "vs_reference" in t["exactness"]:
            e = t["exactness"]["vs_reference"]
            typer.echo(f"{'':10} vs reference: {e['mismatched']} of {e['total']} elements differ")
        for b, lat in t.get("latency_ms", {}).get("per_batch", {}).items():
            typer.echo(f"{'':10} latency batch {b}: {name} {lat['cpu']['median']:.2f}"
                       f" ms, eager fp32 {lat['eager_fp32']['median']:.2f} ms "
                       f"({lat['speedup_vs_eager_fp32']:.2f}x)")
    for ch in report["accuracy"].get("checks", []):
        if not ch["passed"]:
            typer.echo(f"  failed: {ch['key']} {ch['threshold']} (measured {ch['value']}) "
                       f"{ch['note']}")


@app.command()
@_user_errors
def run(recipe: RecipeArg, target: TargetOpt = None, out: OutOpt = None,
        quiet: QuietOpt = False) -> None:
    """Quantize → compile → check accuracy → write report.json and report.md. Exits 1 when no
    requested target ran (the report still says why each did not)."""
    _setup_logging()
    report = _run(recipe, target, out, quiet)
    if not any(t["status"] == "ok" for t in report["targets"].values()):
        typer.echo("qcompile: no requested target ran (see report.json: targets)", err=True)
        raise typer.Exit(1)


@app.command()
@_user_errors
def check(recipe: RecipeArg, target: TargetOpt = None, out: OutOpt = None,
          quiet: QuietOpt = False) -> None:
    """Like ``run``, then exit 1 when any accuracy threshold of the recipe fails."""
    _setup_logging()
    report = _run(recipe, target, out, quiet)
    failed = [n for n, t in report["targets"].items()
              if t["status"] == "ok" and not t["accuracy"]["passed"]]
    ran = [n for n, t in report["targets"].items() if t["status"] == "ok"]
    if failed or not ran:
        raise AccuracyError(
            "accuracy check failed" if failed else "accuracy check ran on no target",
            at=str(recipe), why=f"thresholds missed on: {', '.join(failed)}" if failed
            else "every requested target was unavailable",
            next="see report.md for the measured values")
    typer.echo("accuracy check passed")


@app.command()
@_user_errors
def inspect(recipe: RecipeArg,
            dump_ir: Annotated[Path | None, typer.Option(
                "--dump-ir", help="write the QIR after each pass into this folder")] = None,
            batch: Annotated[int, typer.Option(help="batch size to specialise for")] = 1,
            kernels: Annotated[bool, typer.Option(
                "--kernels", help="also compile for cpu and show the dispatches per chain")
            ] = False,
            accuracy: Annotated[bool, typer.Option(
                "--accuracy", help="also show each fused chain's SQNR vs float and vs PT2E on "
                                   "the first evaluation batch")] = False,
            why_not_faster: Annotated[bool, typer.Option(
                "--why-not-faster", help="also show what keeps the graph from int8 speed: "
                                         "float MACs, float islands, dq/q left, chain lengths, "
                                         "bytes moved")] = False) -> None:
    """Quantize, run the pass pipeline, show fused chains, int8 residency and float ops."""
    _setup_logging()
    from qcompile.frontend.quantize import QuantizeConfig, quantize
    from qcompile.passes.residency import residency
    from qcompile.pipeline import build_model, calibration_batches
    from qcompile.recipe import load_recipe
    from qcompile.reference.program import lower

    r = load_recipe(recipe)
    mut = build_model(r)
    q = quantize(mut.module, mut.example_inputs(), calibration_batches(r, mut),
                 QuantizeConfig.from_recipe(r))
    lowered = lower(q, batch, dump_dir=str(dump_ir) if dump_ir else None)
    res = residency(lowered.graph)
    typer.echo(f"{r.name}: passes fired " + ", ".join(f"{k} {v}" for k, v in
                                                      lowered.stats.items() if v))
    typer.echo(f"int8 bytes fraction {res['int8_bytes_fraction']:.4f} (int8 {res['int8_bytes']}"
               f" B, float {res['float_bytes']} B, i32 kept in chains {res['i32_fused_bytes']} B)")
    typer.echo(f"fused chains: {res['chain_count']}; int8 segments: {res['segments']}")
    for c in res["chains"]:
        typer.echo(f"  chain  {'+'.join(c['ops']):40} -> {c['out']}  {c['loc']}")
    for f in res["float_ops"]:
        typer.echo(f"  float  {f['op']:12} {f['region']:7} {f['loc']}: {f['reason']}")
    if dump_ir:
        typer.echo(f"QIR stages written to {dump_ir}")
    if kernels:
        _print_kernels(lowered.graph, batch, r.compile.keep_dir)
    if accuracy:
        _print_attribution(r, mut, q, lowered.graph, batch)
    if why_not_faster:
        from qcompile.passes import why_not_faster as wnf

        for line in wnf.text(wnf.why_not_faster(lowered.graph)):
            typer.echo(line)


def _print_attribution(r: Any, mut: Any, q: Any, graph: Any, batch: int) -> None:
    from qcompile.accuracy.attribution import attribution
    from qcompile.pipeline import evaluation_batches
    from qcompile.reference.program import lower
    from qcompile.report.attribution import text

    x = evaluation_batches(r, mut, q)[0].inputs
    if int(x[0].shape[0]) != batch:
        graph = lower(q, int(x[0].shape[0])).graph
    for line in text(attribution(graph, q, x)):
        typer.echo(line)


def _print_kernels(graph: Any, batch: int, keep_dir: str | None) -> None:
    from qcompile.codegen import cpu
    from qcompile.codegen.target import analyze_kernels

    runner, rep = cpu.build({batch: graph}, keep_dir=keep_dir)
    k = analyze_kernels(runner)
    typer.echo(f"cpu dispatches (batch {batch}): {k['total']} ({k['by_kind']}); contraction "
               f"chains: max {k['max_per_chain']} dispatch(es) per chain; {k['i32_writes']} "
               f"dispatch(es) write i32" + (f"; workaround {rep['workarounds']}"
                                            if rep["workarounds"] else ""))
    for c in k["per_chain"]:
        typer.echo(f"  {c['dispatches']} dispatch  {'+'.join(c['ops']):18} writes "
                   f"{','.join(c['writes']):8} {c['loc']}")


@app.command()
@_user_errors
def bench(recipe: RecipeArg, out: OutOpt = None,
          peer: Annotated[list[str] | None, typer.Option(
              "--peer", help="engine to compare with (repeatable); default: the recipe's "
                             "benchmark.peers")] = None,
          batch: Annotated[list[int] | None, typer.Option(
              "--batch", "-b", help="batch size (repeatable); default: benchmark.batch_sizes")
          ] = None,
          repeats: Annotated[int | None, typer.Option(help="timed rounds per engine")] = None,
          no_profile: Annotated[bool, typer.Option("--no-profile",
                                                   help="skip the dispatch profile")] = False,
          quiet: QuietOpt = False) -> None:
    """Time qcompile's cpu target against eager, Inductor, ONNX Runtime (same run, same threads)."""
    _setup_logging()
    from qcompile.bench.suite import run_bench, write_bench
    from qcompile.recipe import PEERS, load_recipe

    for p in peer or ():
        if p not in PEERS:
            from qcompile.errors import RecipeError

            raise RecipeError(f"unknown peer {p!r}", at="--peer",
                              why=f"valid peers: {', '.join(PEERS)}", next="pass a valid peer")
    r = load_recipe(recipe)
    report = run_bench(r, peers=peer, batch_sizes=batch, repeats=repeats,
                       profile=not no_profile, progress=not quiet)
    paths = write_bench(report, out or Path("out") / r.name / "bench")
    for row in report["batches"]:
        cells = ", ".join(f"{k} {v['median']}{'*' if v['noisy'] else ''}"
                          for k, v in row["ms"].items())
        typer.echo(f"batch {row['batch']}: {cells} (ms)")
        if row["host_unsteady"]:
            lo, hi = row["int8_ceiling_range_gops"]
            typer.echo(f"batch {row['batch']}: the int8 ceiling probe ran at {lo}–{hi} GOPS "
                       "across the windows (p10–p90): the host was busy, every cell is "
                       "flagged noisy (*); rerun on a quieter machine")
    for b, s in report["summary"].items():
        typer.echo(f"{b}: qcompile {s['speedup_vs_best_int8']}x vs {s['best_int8_peer']}")
    typer.echo("wrote " + ", ".join(map(str, paths)))


@app.command("compile")
@_user_errors
def compile_cmd(recipe: RecipeArg,
                output: Annotated[Path, typer.Option("--output", "-o",
                                                     help="artifact path, e.g. model.qca")],
                batch: Annotated[list[int] | None, typer.Option(
                    "--batch", "-b", help="batch size to compile (repeatable); default: the "
                                          "recipe's compile.batch_sizes")] = None,
                quiet: QuietOpt = False) -> None:
    """Quantize a recipe's model and compile it for cpu into a .qca artifact."""
    _setup_logging()
    from dataclasses import replace

    from qcompile.frontend.quantize import QuantizeConfig, quantize
    from qcompile.pipeline import build_model, calibration_batches, compile_options
    from qcompile.recipe import load_recipe
    from qcompile.targets import compile_quantized

    r = load_recipe(recipe)
    mut = build_model(r)
    q = quantize(mut.module, mut.example_inputs(), calibration_batches(r, mut),
                 QuantizeConfig.from_recipe(r), progress=not quiet)
    options = compile_options(r, q)
    if batch:
        options = replace(options, batch_sizes=tuple(batch))
    model = compile_quantized(q, "cpu", replace(options, analyze=False))
    path = model.save(output)
    lengths = model.report.get("seq_lens", {}).get("compiled")
    typer.echo(f"wrote {path} (batch sizes {sorted(model.runner.modules)}"
               + (f", sequence lengths {lengths})" if lengths else ")"))


@app.command("exec")
@_user_errors
def exec_cmd(artifact: Annotated[Path, typer.Argument(help="a .qca artifact")],
             inputs: Annotated[list[Path], typer.Option(
                 "--input", "-i", help=".npy file per model input, in order")],
             output: Annotated[Path, typer.Option("--output", "-o",
                                                  help=".npz file for the outputs")]) -> None:
    """Run a saved artifact on .npy inputs; writes the outputs as output_0, ... in an .npz."""
    import io

    import numpy as np
    import torch

    import qcompile
    from qcompile.errors import InputError
    from qcompile.report.writer import atomic_write_bytes

    model = qcompile.load(artifact)
    arrays = []
    for p in inputs:
        why = None
        try:   # memory-mapped: a header declaring a huge shape costs nothing until checked
            a = np.load(p, allow_pickle=False, mmap_mode="r")
        except (OSError, ValueError, EOFError) as err:
            a, why = None, str(err)
        if why is None and not isinstance(a, np.ndarray):
            why = "the file holds several arrays (an .npz); exec reads one .npy per input"
        elif why is None and not a.dtype.isnative:
            why = f"the array's byte order is not this machine's ({a.dtype.str})"
        if why is not None:
            raise InputError(f"cannot read input {p}", at=str(p), why=why,
                             next="pass one .npy file per input, written by numpy.save")
        arrays.append(np.array(a))
    out = model(*[torch.from_numpy(a) for a in arrays])
    outs = out if isinstance(out, tuple) else (out,)
    buf = io.BytesIO()
    np.savez(buf, **{f"output_{i}": o.numpy() for i, o in enumerate(outs)})
    atomic_write_bytes(output, buf.getvalue())
    typer.echo(f"wrote {output} ({', '.join(f'{list(o.shape)}' for o in outs)})")


@app.command("fallback")
@_user_errors
def fallback_cmd(recipe: RecipeArg, out: OutOpt = None,
                 max_float: Annotated[int, typer.Option(
                     help="most modules to keep in float")] = 3,
                 measure_on: Annotated[str, typer.Option(
                     help="target to measure both models' latency on (cpu, ort), or none")
                 ] = "cpu") -> None:
    """Keep the fewest, cheapest fused chains in float until the recipe's accuracy thresholds
    hold (fusion-aware); writes fallback.json and exits 1 if the thresholds still fail."""
    _setup_logging()
    import json

    from qcompile.fallback import search, text
    from qcompile.recipe import load_recipe
    from qcompile.report.writer import atomic_write_text

    r = load_recipe(recipe)
    report = search(r, max_float=max_float,
                    measure_on=None if measure_on == "none" else measure_on)
    path = (out or Path("out") / r.name) / "fallback.json"
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
    for line in text(report):
        typer.echo(line)
    typer.echo(f"wrote {path}")
    if not report["passed"]:
        raise AccuracyError("the fallback search did not meet the thresholds", at=str(recipe),
                            why=f"kept {report['kept_in_float']} in float; still failing: "
                                f"{report['after']['failed']}",
                            next="raise --max-float, or relax the recipe's thresholds")


@app.command("models")
def models() -> None:
    """List the zoo models."""
    from qcompile import zoo

    for name in zoo.names():
        typer.echo(name)


class _Terminated(BaseException):
    """SIGTERM as an exception: what is running unwinds (a running iree-compile is killed and
    reaped by ``iree_cpu._run``, temp folders are removed) before the process ends by the signal."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def main() -> None:
    import os
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        app()
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main()
