"""tandem.server: the OpenAI-compatible HTTP server (FastAPI + uvicorn), the
scheduler process behind it, the ``tandem`` command line and Prometheus metrics.

Start it with ``tandem serve`` (``tandem.server.cli``); ``tandem.server.app`` holds
the routes, ``scheduler_process`` the engine's process and ``scheduler_client`` the
API side of the ZMQ pipes between them.
"""

LAYER = "server"
