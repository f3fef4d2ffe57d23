"""The HTTP entry point: the FastAPI routes and the SSE relay (the request path they call is
gateway/serving/; the app that composes them, gateway/app.py)."""
