"""Cross-cutting suites over whole clusters: acceptance, faults, one error vocabulary, real vLLM."""
