"""Benchmarks as programs: seeded workloads, the same for every engine compared, JSON results."""
