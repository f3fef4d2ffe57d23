"""What tests and benchmarks both use to run a real kvgate cluster on 127.0.0.1: the processes,
the workloads that drive them, the clients that read them back, and what a run's results mean
(hit rate, the warm tail, the start-up floor). Tests import this, never bench/."""
