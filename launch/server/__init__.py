"""The HTTP layer of ``dp-runtime serve``: an OpenAI-compatible FastAPI app over the Engine.

``protocol`` (request models, their checks, response bodies), ``text`` (tokenizer, chat
template, incremental detokenization, stop strings), ``request_flow`` (one engine request's life
on the engine), ``choices`` (the ``n`` engine requests of one HTTP request), ``respond`` (their
JSON body or server-sent events), ``metrics`` (Prometheus, on the server's own registry),
``app`` (the routes).
Nothing here imports torch or the engine at import time.
"""
