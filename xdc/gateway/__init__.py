"""The OpenAI-compatible gateway: clients send completions here; it asks the router where to
prefill, drives the prefill and decode engines (vLLM with the xdc connector) and streams the
answer back. Pure parts: ``nodes`` (the node map), ``plan`` (router decision -> what to run),
``openai`` (client requests and error bodies); the aiohttp shell is ``app``."""
