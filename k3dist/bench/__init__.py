"""Benchmark kit, a module a job: reports (``record``), builds, routing, baselines,
collectives, stepping, compare, decode, bandwidth; the convert memory bound, the cost
model of K3, the quality evaluation."""
