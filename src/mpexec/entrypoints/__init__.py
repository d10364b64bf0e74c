"""The OpenAI-compatible HTTP server (``mpexec serve``) on an :class:`AsyncLLM`.

::

    HTTP client ──► uvicorn ──► FastAPI app (api_server.build_app)
                                   │ protocol: request JSON ──► prompt + SamplingParams
                                   │           (checked; a mistake is a 400 in the
                                   │            OpenAI error shape)
                                   ▼
                                AsyncLLM.add_request ──► RequestStream
                                   │ SSE chunks (stream: true) or one JSON reply
                                   ▼
                                metrics: Prometheus text at /metrics

``launch.serve`` runs uvicorn with the signals handled: SIGTERM or Ctrl-C
stops accepting, lets in-flight requests finish for a grace period (then
they are cancelled, which aborts them), shuts the executor down and returns.
This package imports the engine; the engine never imports it.  It needs the
``serve`` extra (fastapi, uvicorn, prometheus-client).
"""
