"""The pass pipeline: one ordered list, the IR verified after every pass, firings counted, each
stage dumped on request (``dump_dir``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qcompile.ir.graph import Graph
from qcompile.ir.printer import print_graph
from qcompile.ir.verify import verify
from qcompile.passes.base import Pass
from qcompile.passes.cancel_dq_q import CancelDqQ
from qcompile.passes.channels_last import ChannelsLast
from qcompile.passes.check_integer_only import CheckIntegerOnly
from qcompile.passes.dead_code import DeadCode
from qcompile.passes.fold_relu_into_quant import FoldReluIntoQuant
from qcompile.passes.fold_weight_quant import FoldWeightQuant
from qcompile.passes.fuse_contraction_dequant import FuseContractionDequant
from qcompile.passes.fuse_contraction_requant import FuseContractionRequant
from qcompile.passes.fuse_int8_add_mul import FuseInt8AddMul
from qcompile.passes.fuse_residual_add import FuseResidualAdd
from qcompile.passes.int8_data_movement import Int8DataMovement
from qcompile.passes.int8_layer_norm import Int8LayerNorm
from qcompile.passes.int8_mask_add import Int8MaskAdd
from qcompile.passes.int8_softmax import Int8Softmax
from qcompile.passes.unary_to_lut import UnaryToLut


def default_pipeline(float_ops: str = "fallback") -> tuple[Pass, ...]:
    return (
        FoldWeightQuant(),         # Q(const f32) -> const i8: weight DQs then read int8 constants
        DeadCode(),                # identity reshapes/permutes would hide patterns below
        FoldReluIntoQuant(),       # Q(relu(x)) == Q(x) with a narrower clamp: exposes Q(conv)
        FuseResidualAdd(),         # Q(add(conv, DQ r)): the residual joins the conv epilogue
        FuseContractionRequant(),  # Q(conv/linear/matmul(DQ, DQ W)) -> REQUANT(QCONV ...)
        FuseInt8AddMul(),          # Q(add/mul(DQ a, DQ b)) on int8 operands
        Int8DataMovement(),        # pools, reshapes, permutes, pads, cats stay int8
        UnaryToLut(),              # Q(f(DQ x)) for elementwise f: a 256-entry table
        Int8MaskAdd(),             # Q(DQ x + g(mask)): two tables picked by the integer mask
        Int8Softmax(),             # Q(softmax(DQ x)): integer exp table, i64 sums
        Int8LayerNorm(),           # Q(layer_norm(DQ x)): i64 row sums, integer square root
        CancelDqQ(),               # DQ -> Q pairs left between int8 producers and consumers
        FuseContractionDequant(),  # contractions feeding float (logits): int8 math, f32 out
        ChannelsLast(),            # convs/pools NHWC once every int8 chain is formed
        DeadCode(),
        CheckIntegerOnly(float_ops),  # gate: every float op left is an explicit fallback
    )


@dataclass
class PipelineResult:
    graph: Graph
    stats: dict[str, int] = field(default_factory=dict)


def run_pipeline(g: Graph, passes: Sequence[Pass] | None = None, *,
                 dump_dir: str | Path | None = None) -> PipelineResult:
    passes = default_pipeline() if passes is None else passes
    verify(g, stage="import")
    stats: dict[str, int] = {}
    _dump(dump_dir, 0, "import", g)
    for i, p in enumerate(passes, start=1):
        g, fired = p.run(g)
        stats[p.name] = stats.get(p.name, 0) + fired
        verify(g, stage=p.name)
        _dump(dump_dir, i, p.name, g)
    return PipelineResult(g, stats)


def _dump(dump_dir: str | Path | None, i: int, name: str, g: Graph) -> None:
    if dump_dir is None:
        return
    path = Path(dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{i:02d}-{name}.qir").write_text(print_graph(g, locs=True), encoding="utf-8")
