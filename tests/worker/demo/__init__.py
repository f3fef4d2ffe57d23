"""Tests of worker/demo/: the generated demo models."""
