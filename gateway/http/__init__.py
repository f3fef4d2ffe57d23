"""The HTTP side of the request path: the app, its routes, serving, the upstream client,
retries, the SSE relay."""
