"""The GEMM core (`matmul`, its Hopper ping-pong variant) and the fused GEMM + communication ops."""
