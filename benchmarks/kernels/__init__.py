"""Kernel micro-benchmarks: one kernel family against its alternatives, each run as
``python -m benchmarks.kernels.<tool>``."""
