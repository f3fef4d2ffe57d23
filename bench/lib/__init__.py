"""Code the benchmark entry points share: tables and JSON (`report`), runs of the chat workload
(`runs`), closed-loop load (`closed_loop`), load at several concurrencies (`load_runs`), a
round-robin TCP front over several gateways (`front`), engine timing and its yardsticks
(`engine_timing`, `engine_reference`)."""
