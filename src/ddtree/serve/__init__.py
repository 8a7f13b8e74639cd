"""``ddtree serve``: the engine behind an OpenAI-compatible HTTP API.

- ``protocol``: request validation and response bodies, as the ``openai`` client speaks them
- ``chat``: messages -> prompt ids through the checkpoint's chat template (reusable)
- ``text``: the streamed text of a completion (EOS left out, stop strings cut)
- ``worker``: the engine thread, one request at a time, cancel at the next step
- ``app``: the Starlette app (checks, admission, SSE); ``metrics``: ``/metrics``
- ``recorder``: engine_run records per request; ``server``: socket, warm-up, uvicorn
- ``loadgen``: the load client of ``ddtree bench serve``

Modules import Starlette/uvicorn/torch themselves; importing the package imports nothing.
"""
