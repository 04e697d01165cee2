"""The server's HTTP routes, one module per surface.

``openai`` serves ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``;
``native`` SGLang's ``/generate``; ``admin`` the health checks, ``/server_info`` and
``/metrics``; ``gateway`` what the SGLang Model Gateway reads of a worker. ``common``
holds what the OpenAI and native routes share.
"""
