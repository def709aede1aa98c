"""GPU kernels. `elementwise` (norms, SiLU-and-mul, RoPE, the KV store) runs anywhere and uses Triton only for
CUDA tensors; `attention` (paged decode / extend) needs Triton. No module here imports Triton unguarded, and this
package imports none of them eagerly."""
