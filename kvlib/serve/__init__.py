"""``kvlib serve``: an OpenAI-compatible HTTP server in front of one ``LLM``, the engine stepping in one loop.

Beside the engine, not part of it: the engine imports nothing from here. The modules, in the order a
request meets them: ``limits`` (how much one request may ask for), ``protocol`` (the OpenAI request
shapes and their checks), ``requests`` (a checked request as engine requests), ``engine_loop`` (the
one thread that steps the engine and feeds each request's queue), ``generation`` (one HTTP request's
choices, their text and stop strings), ``responses`` (the OpenAI response and chunk shapes), ``app``
(the ASGI routes), ``prometheus`` (``/metrics``), ``server`` (uvicorn, in the foreground or in a
background thread) and ``command`` (``kvlib serve``'s options). Nothing here is imported by
``import kvlib``; the server needs the ``serve`` extra (in a clone, ``pip install -e ".[serve]"``).
"""
