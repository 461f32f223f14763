"""Bench (tools): the benchmark library that benchmarks/ scripts run.

Reports (``record``), builds, routing, baselines, collectives, stepping, compare,
decode, bandwidth, the convert memory bound, the cost model of K3 (``costmodel``), the
quality evaluation (``evaluate``), greedy generation (``greedy``: ``launch/generate.py``)
and the API fuzzer (``fuzz``). May import every layer below."""
