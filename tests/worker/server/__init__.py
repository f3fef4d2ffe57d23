"""Tests of worker/server/: a real `python -m worker` over HTTP and ZMQ."""
