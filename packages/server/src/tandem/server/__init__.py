"""tandem.server: the OpenAI-compatible HTTP server (FastAPI + uvicorn), the
scheduler process behind it, the ``tandem`` command line and Prometheus metrics.

Start it with ``tandem serve`` (``tandem.server.cli``); ``tandem.server.app`` builds
the application from the routes of ``routes/``, ``scheduler_process`` is the engine's
process and ``scheduler_client`` the API side of the ZMQ pipes between them.
"""

LAYER = "server"
