"""The worker's HTTP/ZMQ service: OpenAI API, health, metrics, KV events, peer endpoints."""
