"""Per-dispatch profile of a compiled ``cpu`` module: ``iree-benchmark-module`` with IREE's HAL
host-execution profiling, summarised by ``iree-profile statistics``, each dispatch attributed
to the QIR chain it computes (through :mod:`qcompile.codegen.kernels`)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from qcompile.codegen import iree_cpu, kernels, ukernel
from qcompile.codegen.cpu import BatchModule


def _tool(name: str) -> str:
    import iree.runtime

    return str(Path(iree.runtime.__file__).parent.parent / "_runtime_libs" / name)


def dispatch_profile(module: BatchModule, inputs: list[np.ndarray], *, repetitions: int = 5,
                     top: int = 15) -> dict[str, Any]:
    """The slowest dispatches (total time over the repetitions) with their chains. A pooled
    module runs with its pool operand zero: each dispatch's workgroups on one thread."""
    with tempfile.TemporaryDirectory(prefix="qcompile-prof-") as tmp:
        vmfb = Path(tmp) / "m.vmfb"
        vmfb.write_bytes(module.vmfb)
        args = []
        for i, x in enumerate(inputs):
            np.save(Path(tmp) / f"in{i}.npy", np.ascontiguousarray(x))
            args.append(f"--input=@{Path(tmp) / f'in{i}.npy'}")
        if module.pooled:
            args.append(f"--input={ukernel.CTX_SIZE}xi64=0")
        args += _storage_inputs(module.vmfb)
        prof = Path(tmp) / "p.ireeprof"
        subprocess.run([_tool("iree-benchmark-module"), f"--module={vmfb}", "--device=local-task",
                        "--function=main", *args, f"--benchmark_repetitions={repetitions}",
                        "--device_profiling_mode=host-execution",
                        f"--device_profiling_output={prof}"], capture_output=True, text=True,
                       check=True, timeout=600)
        stats = subprocess.run([_tool("iree-profile"), "statistics", "--format=jsonl", str(prof)],
                               capture_output=True, text=True, check=True, timeout=300).stdout
    rows = _function_rows(stats)
    owners = _owners(module)
    total = sum(r["total_ns"] for r in rows) or 1
    rows.sort(key=lambda r: -r["total_ns"])
    for r in rows:
        r["share"] = round(r["total_ns"] / total, 4)
        r["chain"] = owners.get(r["dispatch"])
    kinds: dict[str, float] = {}
    for r in rows:
        k = kernels._kind(r["dispatch"]) if "encode" not in r["dispatch"] else "pack"
        kinds[k] = kinds.get(k, 0.0) + r["share"]
    return {"batch": module.batch, "dispatches": len(rows),
            "share_by_kind": {k: round(v, 4) for k, v in sorted(kinds.items())},
            "top": rows[:top]}


def _storage_inputs(vmfb: bytes) -> list[str]:
    """``--input`` flags for the storage a module takes for its results and transients
    (:func:`qcompile.codegen.iree_cpu.storage_args`): zeroed buffers of their sizes."""
    import iree.runtime as rt

    instance = rt.VmInstance()
    vm = rt.VmModule.copy_buffer(instance, vmfb)     # both outlive the function's reflection
    main = vm.lookup_function("main")
    outputs, transients = iree_cpu.storage_args(dict(main.reflection) if main else {})
    return [f"--input={n}xi8=0" for n in outputs] + (
        [f"--input=&{max(transients, 64)}xi8=0"] if transients is not None else [])


def _function_rows(jsonl: str) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for line in jsonl.splitlines():
        row = json.loads(line)
        name = row.get("function_name")
        if row.get("row_type") != "host_execution_function" or not name or \
                "total_duration_ns" not in row:
            continue
        seen[name] = {"dispatch": name, "total_ns": int(row["total_duration_ns"]),
                      "count": int(row.get("sample_count") or 0)}
    return list(seen.values())


def _owners(module: BatchModule) -> dict[str, str]:
    """``entry name -> chain location`` from the flow IR."""
    if module.mlir is None or module.graph is None:
        return {}
    execs, calls = kernels.parse_flow(iree_cpu.compile_to_flow(module.mlir, module.flags))
    ids = {k: n for k, n in enumerate(module.graph.nodes())}
    out = {}
    for c in calls:
        members = sorted(k for k, copy in execs.get(c["executable"], ()) if not copy)
        if members:
            n = ids[members[0]]
            out[c["entry"]] = f"{n.op.value} {n.loc}"
    return out
