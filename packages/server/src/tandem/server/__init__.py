"""tandem.server: the OpenAI-compatible HTTP server (FastAPI + uvicorn), the
scheduler process behind it, the ``tandem`` command line and Prometheus metrics.

This layer is being built (see the Server issue); for now it only proves that it
installs in the shared ``tandem`` namespace.
"""

LAYER = "server"
