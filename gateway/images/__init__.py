"""Images on the request path: remote fetching, its SSRF guard, and forwarded image parts."""
