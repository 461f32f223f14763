"""Bench (tools): the benchmark library; the runnable benchmarks are benchmarks/<subject>/.

This package is what the benchmark scripts import; the scripts themselves, grouped by
subject (speed, quality, memory, pipeline, serving, agents, faults), and their results
(benchmarks/results/<date>/, indexed in benchmarks/README.md by benchmarks/index.py) live
outside it. Reports (``record``), builds, routing, baselines, collectives, stepping,
compare, decode, bandwidth, the convert memory bound, the cost model of K3
(``costmodel``), the quality evaluation (``evaluate``), greedy generation (``greedy``:
``launch/generate.py``) and the API fuzzer (``fuzz``). May import every layer below."""
