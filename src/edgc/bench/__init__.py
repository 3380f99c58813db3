"""Benchmarks: emulated slow-link clusters, micro and end-to-end comparisons, simulation."""
