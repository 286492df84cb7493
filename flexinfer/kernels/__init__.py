"""Attention kernels over a vtm space: one call per layer for the whole batch."""
