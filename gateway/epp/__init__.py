"""kvgate as the endpoint picker (EPP) of a Gateway API InferencePool.

A proxy that implements the inference extension (Istio, Agentgateway, NGINX Gateway Fabric,
...) asks the EPP, over Envoy's ext_proc gRPC protocol, which pod of the pool serves each
request. `python -m gateway --epp` serves that protocol on `--epp-port` beside the HTTP API, and
decides with the HTTP gateway's own request path (gateway/routing/request.py): the same parsing,
limits, tenants, rendering and block keys, index, policies and predicted cached tokens.
"""

from .server import EppServer

__all__ = ["EppServer"]
