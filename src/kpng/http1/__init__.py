"""HTTP/1.1 on asyncio streams: the client kpng lists and watches the API server with, and the
server of its status addresses (``/healthz``, ``/metrics``, ``/debug/*``) and health check node
ports. h11 parses what both read, the answers and the requests: a strict parser, for bytes that
come from anyone (an API server's answers pass through proxies and load balancers).

Both are small on purpose. kpng asks for a handful of things over HTTP: GETs with a body read
whole or streamed line by line, a POST, and answers to GETs. aiohttp did this before, for most
of a quarter of a second of a node agent's start (a 1,000-service first sync: 0.88 s with it,
0.62 s without), spent on machinery kpng never used: cookies, multipart, websockets, tracing, two
default TLS contexts built at import.
"""

from kpng.http1.client import HttpClient, HttpError, Response
from kpng.http1.server import Reply, Request, serve

__all__ = ["HttpClient", "HttpError", "Reply", "Request", "Response", "serve"]
