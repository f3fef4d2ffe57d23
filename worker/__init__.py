"""kvgate worker: torch inference engine with a paged, multimodal-aware prefix cache."""
