"""kpng's own Kubernetes API client: where the API server is and how to authenticate (``config``),
and its requests, lists and watches (``client``). Used by the ``kube`` source, which lists and
watches, and by the to-api server, which asks the API server to review node tokens."""
