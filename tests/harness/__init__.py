"""Tests of harness/: what the tests and the benchmarks share to run a cluster."""
