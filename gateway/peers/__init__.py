"""Gateway replicas that act as one: each tells its peers where it routed (placements) and how
many requests it holds on each replica (load), over ZMQ with the worker token's CURVE keys.
docs/gateway.md, "Gateway peers"."""
