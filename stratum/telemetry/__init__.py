"""Per-request cost, debug traces and Prometheus metrics, all from figures the runtime measured."""
