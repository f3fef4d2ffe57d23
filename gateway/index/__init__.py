"""The prefix-cache index: which replicas hold which blocks (fed by gateway/events/)."""
