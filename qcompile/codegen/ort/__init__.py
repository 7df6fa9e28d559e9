"""Target ``ort``: QIR after the pass pipeline exported as an integer ONNX model and run by ONNX
Runtime (see :mod:`qcompile.codegen.ort.export`)."""
