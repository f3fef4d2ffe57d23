"""The OpenAI API as both sides speak it: request models, errors, validation wording, SSE.

The gateway validates a client's body with the same strict models (protocol.py, embeddings.py)
the worker validates it with again, refuses with the same `APIError` (errors.py), words a
validation error the same way (validation.py) and ends a stream the same way (sse.py). Each side
adds its own fields in a subclass: the gateway's (gateway/protocol.py,
gateway/serving/embeddings.py) allow unknown fields and forward them; the worker's
(worker/server/protocol.py, worker/server/embedding_protocol.py) ignore them and add what its
engine runs.
"""
