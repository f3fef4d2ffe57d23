"""Tests of worker/."""
