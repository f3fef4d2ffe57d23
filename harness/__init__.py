"""What tests and benchmarks both use to run a real kvgate cluster on 127.0.0.1: the processes,
the workloads that drive them, and the clients that read them back."""
