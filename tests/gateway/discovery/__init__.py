"""Tests of gateway/discovery/: EndpointSlices and InferencePools through the real client."""
