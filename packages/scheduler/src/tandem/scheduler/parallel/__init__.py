"""Tensor-parallel ranks: the process group and the batch broadcast to follower ranks."""
