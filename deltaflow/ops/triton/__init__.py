"""Triton kernels (see kernels.py)."""
