"""``report.json`` (machine-readable, stable keys from DESIGN.md) and ``report.md`` (for people).

Files are written atomically: each to a temp file beside it (created with the usual umask
permissions, not ``mkstemp``'s 0600), flushed and synced, then renamed over the target. SIGINT and
SIGTERM arriving meanwhile are held until the renames are done and then delivered, so an
interrupted run leaves the old files or the complete new ones (``report.json`` and ``report.md``
as a pair), and never a temp file.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from qcompile.signals import signals_held


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write_many({path: data})


def atomic_write_many(files: dict[Path, bytes]) -> None:
    """Write every file, then rename them all in order (see the module docstring)."""
    temps: list[Path] = []
    with signals_held():
        try:
            for path, data in files.items():
                temps.append(_write_temp(Path(path), data))
            for path, tmp in zip(files, temps, strict=True):
                os.replace(tmp, path)
        except BaseException:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            raise


def _write_temp(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:   # mode 0o666 & ~umask, like any new file
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    text = json.dumps(report, indent=2, sort_keys=False, allow_nan=False) + "\n"
    # both rendered before either is written; report.json, what tools read, renamed last
    atomic_write_many({md_path: render_markdown(report).encode("utf-8"),
                       json_path: text.encode("utf-8")})
    from qcompile.report.attribution import write_plots

    write_plots(report, out_dir)
    return json_path, md_path


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _seq_lens(model: dict[str, Any]) -> str:
    """The compiled sequence lengths of a token model (and why only one, when so)."""
    lengths = model.get("seq_lens")
    if not lengths:
        return ""
    why = f" ({model['seq_lens_why']})" if model.get("seq_lens_why") else ""
    return f", sequence lengths {lengths}{why}"


def render_markdown(r: dict[str, Any]) -> str:
    lines = [f"# qcompile report: {r['recipe']['name']}", "",
             f"- model: `{r['model']['name']}` ({r['model']['task']}, "
             f"{r['model']['parameters']:,} parameters, inputs {r['model']['input_shapes']}, "
             f"dynamic batch: {r['model']['dynamic_batch']}{_seq_lens(r['model'])})",
             f"- recipe: `{r['recipe']['path']}`",
             f"- quantizer: {r['quantization']['quantizer']} ({r['quantization']['weights']}, "
             f"{r['quantization']['activations']}), calibration "
             f"{r['quantization']['calibration']}",
             f"- quantized ops: {r['quantization']['quantized_ops']}",
             f"- evaluation: {r['evaluation']}", ""]
    lines += _targets_table(r["targets"])
    lines += _checks_section(r)
    lines += _compiled_section(r["targets"])
    from qcompile.report.attribution import markdown as attribution_markdown

    lines += attribution_markdown(r["targets"])
    lines += ["", "## Versions", "", ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
              "", f"Timings (s): {r['timings_s']}", ""]
    return "\n".join(lines)


def _targets_table(targets: dict[str, Any]) -> list[str]:
    cols = ["sqnr_db", "cosine", "max_abs", "top1_agreement", "top5_agreement"]
    lines = ["## Targets", "", "| target | status | float | int8 | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 4) + "|"]
    for name, t in targets.items():
        if t["status"] != "ok":
            lines.append(f"| {name} | {t['status']}: {t.get('reason', '')} |" + " |" *
                         (len(cols) + 2))
            continue
        a = t["accuracy"]
        cells = [_fmt(a["compare"].get(c, "—")) for c in cols]
        lines.append(f"| {name} | ok | {_fmt(a['float'] or '—')} | {_fmt(a['int8'] or '—')} | "
                     + " | ".join(cells) + " |")
    return lines


def _compiled_section(targets: dict[str, Any]) -> list[str]:
    """Exactness, dispatches and latency of compiled targets."""
    lines: list[str] = []
    for name, t in targets.items():
        if t.get("status") != "ok" or "kernels" not in t:
            continue
        if "vs_reference" not in t.get("exactness", {}):     # target cuda: kernel launches
            lines += _launches_section(name, t)
            continue
        e, k = t["exactness"]["vs_reference"], t["kernels"]
        lines += ["", f"## Target {name}", "",
                  f"- vs reference: {e['mismatched']} of {e['total']} output elements differ "
                  f"(batch sizes {t['compile']['batch_sizes']})",
                  f"- dispatches at batch {k.get('batch')}: {k.get('total')} {k.get('by_kind')};"
                  f" contraction chains {k.get('chains')}, at most {k.get('max_per_chain')} "
                  f"dispatch(es) per chain, {k.get('i32_writes')} dispatch(es) write i32",
                  f"- workarounds: {t['compile']['workarounds'] or 'none'}; compile s per batch:"
                  f" {t['compile']['compile_s_per_batch']}"]
        for b, lat in t.get("latency_ms", {}).get("per_batch", {}).items():
            lines.append(f"- latency batch {b} (median ms): {name} "
                         f"{lat['cpu']['median']}, eager fp32 {lat['eager_fp32']['median']} "
                         f"({lat['speedup_vs_eager_fp32']}x)")
    return lines


def _launches_section(name: str, t: dict[str, Any]) -> list[str]:
    k = t["kernels"]
    host = ", ".join(f"{h['op']} ({h['reason']})" for h in k.get("host_ops", [])) or "none"
    return ["", f"## Target {name}", "",
            f"- {t.get('mode', 'compiled')} on {t.get('device', '?')}: {k.get('total')} kernel "
            f"launches per run {k.get('by_kernel')}, {k.get('fused_chains')} fused chains (one "
            f"kernel each), torch ops {k.get('torch_ops')}, host ops: {host}"]


def _checks_section(r: dict[str, Any]) -> list[str]:
    lines = ["", f"## Accuracy checks ({r['target']}): "
             f"{'PASSED' if r['accuracy'].get('passed') else 'FAILED'}", ""]
    for c in r["accuracy"].get("checks", []):
        mark = "pass" if c["passed"] else "FAIL"
        value = "not measured" if c["value"] is None else _fmt(c["value"])
        note = f" ({c['note']})" if c["note"] else ""
        lines.append(f"- {mark}: {c['key']} = {_fmt(c['threshold'])}, measured {value}{note}")
    if not r["accuracy"].get("checks"):
        lines.append("- the recipe sets no accuracy thresholds")
    return lines
