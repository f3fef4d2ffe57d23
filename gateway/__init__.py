"""kvgate gateway: OpenAI-compatible, cache-aware routing proxy. Never imports torch."""
