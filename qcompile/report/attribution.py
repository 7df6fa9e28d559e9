"""Per-chain attribution for people: a Markdown table, a text table (``qcompile inspect
--accuracy``) and a PNG plot (``attribution.png`` beside ``report.md``)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

PLOT_NAME = "attribution.png"


def _db(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def _short(loc: str | None, width: int = 48) -> str:
    loc = loc or "?"
    return loc if len(loc) <= width else "…" + loc[-(width - 1):]


def markdown(targets: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for name, t in targets.items():
        a = t.get("attribution") if t.get("status") == "ok" else None
        if not a or "chains" not in a:
            continue
        lines += ["", f"## Per-chain attribution ({name}, {a['inputs']} inputs)", "",
                  "SQNR (dB) of each fused chain's output against the float model and against "
                  "PT2E (end to end; *local*: recomputed from PT2E's own inputs). "
                  "*quantization*: PT2E loses as much (the int8 grid's error); *compiler*: the "
                  "chain alone departs from PT2E more than PT2E from float. Plot: "
                  f"`{PLOT_NAME}`.", "",
                  "| # | chain | ops | vs float | vs PT2E | vs PT2E local | PT2E vs float | "
                  "dominant |", "|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(a["chains"]):
            lines.append(f"| {i} | `{_short(r['loc'])}` | {'+'.join(r['ops'] or [])} | "
                         f"{_db(r['sqnr_vs_float_db'])} | {_db(r['sqnr_vs_pt2e_db'])} | "
                         f"{_db(r['sqnr_vs_pt2e_local_db'])} | "
                         f"{_db(r['pt2e_sqnr_vs_float_db'])} | {r['dominant'] or '—'} |")
    return lines


def text(a: dict[str, Any]) -> list[str]:
    lines = [f"per-chain attribution on {a['inputs']} evaluation inputs (SQNR dB): "
             f"{a['compiler_dominated']} chain(s) dominated by compiler error",
             f"  {'#':>3} {'vs float':>8} {'vs pt2e':>8} {'local':>8} {'pt2e/flt':>8}  "
             "dominant      chain"]
    for i, r in enumerate(a["chains"]):
        lines.append(f"  {i:>3} {_db(r['sqnr_vs_float_db']):>8} {_db(r['sqnr_vs_pt2e_db']):>8} "
                     f"{_db(r['sqnr_vs_pt2e_local_db']):>8} "
                     f"{_db(r['pt2e_sqnr_vs_float_db']):>8}  {r['dominant'] or '—':12}  "
                     f"{'+'.join(r['ops'] or []):24} {r['loc']} -> {r['matched']}")
    return lines


def plot_png(a: dict[str, Any], title: str) -> bytes:
    """Bars per chain (graph order): SQNR vs float and vs PT2E, and PT2E's own vs float."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = a["chains"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(rows) + 2), 4.0), dpi=100)
    series = [("sqnr_vs_float_db", "chain vs float"), ("pt2e_sqnr_vs_float_db", "PT2E vs float"),
              ("sqnr_vs_pt2e_db", "chain vs PT2E"),
              ("sqnr_vs_pt2e_local_db", "chain vs PT2E, local")]
    for k, (key, label) in enumerate(series):
        values = [np.nan if r[key] is None else min(r[key], 100.0) for r in rows]
        ax.bar(x + (k - 1.5) * 0.2, values, width=0.2, label=label)
    ax.set_xlabel("fused chain (graph order)")
    ax.set_ylabel("SQNR (dB, capped at 100)")
    ax.set_title(title)
    ax.set_xticks(x[:: max(1, len(rows) // 30)])
    ax.set_ylim(0, 118)             # room above the capped bars for the legend
    ax.legend(loc="upper center", ncol=4, fontsize=8, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write_plots(report: dict[str, Any], out_dir: Path) -> Path | None:
    """``attribution.png`` for the first target that carries an attribution."""
    from qcompile.report.writer import atomic_write_bytes

    for name, t in report.get("targets", {}).items():
        a = t.get("attribution") if t.get("status") == "ok" else None
        if a and a.get("chains"):
            path = out_dir / PLOT_NAME
            atomic_write_bytes(path, plot_png(a, f"{report['recipe']['name']}: per-chain SQNR "
                                                 f"({name})"))
            return path
    return None
