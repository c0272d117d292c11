"""Support code shared by the tests and the benchmarks: the process launcher
(``procs``), worker and gateway processes (``cluster``), the fake OpenAI server,
the transfer-agent child processes, the serving benchmark's load generator and
HTTP client, the fault matrix, and Triton kernels compiled for sm_90 without a
GPU (``sm90``).

Layering: ``benchmarks`` and ``tests`` import ``harness``; ``harness`` imports
the product packages; no product package imports ``harness`` or ``benchmarks``
(``tests/test_layering.py``).
"""
