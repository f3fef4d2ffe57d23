"""Code the benchmark entry points share: tables and JSON (`report`), runs of the chat workload
(`runs`), closed-loop load (`closed_loop`), engine timing and its yardsticks (`engine_timing`,
`engine_reference`)."""
