"""A simulated fleet: N replicas that a gateway cannot tell from N kvgate workers, in one process.

Each replica has its own HTTP port, its own bounded prefix cache (the worker's block manager,
LRU eviction), GPU-like prefill and decode timing, and its own KV-event PUB and replay ROUTER in
the worker's wire format. `python -m harness.fleet --replicas 512 --num-blocks 2000` serves them;
docs/benchmarks.md ("How many replicas one gateway fronts") measures the gateway against them.
"""
