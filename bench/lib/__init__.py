"""Code the benchmark entry points share: tables and JSON, workload runs, reference figures."""
