"""Tests of cachekey/: rendering, block keys, KV events, the worker documents, request types."""
