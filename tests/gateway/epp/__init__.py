"""Tests of gateway/epp/: the endpoint picker over ext_proc, its HTTP/2 transport, behind Envoy."""
