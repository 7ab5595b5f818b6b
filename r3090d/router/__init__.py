"""The router: one public endpoint in front of several vLLM engines, routing by the body's `model`.

It runs in its own process (`python -m r3090d.router`), never in the daemon's
loop, and learns which engines can take requests from the daemon over the link
(link.py). It is built on aiohttp: one maintained library gives both the async
HTTP server and the streaming HTTP client, so a response is passed on chunk by
chunk as it arrives (no buffering of an SSE stream), and a client that goes
away cancels its handler, which closes the upstream connection at once, so vLLM
aborts the request. A uvicorn server with an httpx client would take two
libraries and an ASGI layer for the same.
"""
