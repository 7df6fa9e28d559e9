"""Target ``cuda``: fused int8 chains as Triton kernels for NVIDIA GPUs (sm_80 ``mma.sync`` s8,
sm_90 ``wgmma`` s8).

=============  ====================================================================================
module         role
=============  ====================================================================================
``kernels``    the Triton kernels (implicit-GEMM conv, GEMM, direct window conv, pools, elementwise)
``loader``     loads the kernels compiled (``triton.jit``) or interpreted (``TRITON_INTERPRET``)
``tiles``      shape-specialised block sizes
``epilogue``   a chain's end (requantize / dequantize / i32) packed for the kernels
``lower``      QIR graph → :class:`~.program.Program` (one step per chain or op)
``contract``   the conv / linear / matmul / pool / sum lowerings
``program``    steps, launches, execution on a device (or the CPU, interpreted)
``aot``        ahead-of-time compile of a launch for a ``GPUTarget`` (no GPU needed), PTX checks
``target``     availability, ``compile_cuda``, the runner
=============  ====================================================================================

Nothing here imports Triton until a program is built, so the target's availability can be
reported on machines without it.
"""
