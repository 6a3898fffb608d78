"""The OpenAI-compatible HTTP endpoint in front of the Triton generation model.

* :mod:`.app`: the FastAPI application and its routes.
* :mod:`.requests`: the request models; :mod:`.responses`: the response bodies.
* :mod:`.bridge`: streams between Triton's decoupled model and the HTTP responses.

May import: what :mod:`pipeline.serve` may import.
"""
