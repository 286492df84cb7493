"""Attention kernels over a vtm space's per-layer K/V views: one call per layer
for the whole batch (`cpu_attention` in C++, `triton_attention` on CUDA)."""
