"""Code generation: QIR → MLIR → IREE (``cpu``)."""
