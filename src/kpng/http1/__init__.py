"""HTTP/1.1 on asyncio streams: the client kpng lists and watches the API server with, and the
server of its status addresses (``/healthz``, ``/metrics``, ``/debug/*``).

Both are small on purpose. kpng asks for a handful of things over HTTP: GETs with a body read
whole or streamed line by line, a POST, and answers to GETs. aiohttp did this before, and its
import was some 0.2 s of a node agent's start (a fifth of a 1,000-service first sync), most of it
machinery kpng never used: cookies, multipart, websockets, tracing, two default TLS contexts
built at import.
"""

from kpng.http1.client import HttpClient, HttpError, Response
from kpng.http1.server import Reply, Request, serve

__all__ = ["HttpClient", "HttpError", "Reply", "Request", "Response", "serve"]
