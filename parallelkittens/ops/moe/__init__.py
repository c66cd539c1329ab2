"""Expert parallelism: `moe_layout`, `moe_dispatch_gemm` (tokens pulled to their experts' ranks, fused with the
first expert GEMM) and `moe_gemm_combine` (the second GEMM, its rows sent back and summed per token)."""
