"""Tests of worker/models/: the model implementations against transformers."""
