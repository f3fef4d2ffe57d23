"""Tests of gateway/ (its modules, in process and as a real process in front of real workers)."""
