"""The request path both entry points share, from a request's bytes to its end: reading
(authentication, limits, the request model), the routing decision (gateway/routing/),
forwarding with retries, the usage an answer reports, and the end. gateway/http/ and
gateway/epp/ call down into it."""
