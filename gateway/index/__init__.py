"""The prefix-cache index: which replicas hold which blocks, fed by each replica's KV events."""
