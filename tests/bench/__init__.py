"""Tests of the bench/ scripts, run as a user runs them (never imported: tests/project)."""
