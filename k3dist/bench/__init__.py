"""Benchmark kit: timing and reports, the convert memory bound, the cost model of K3."""
