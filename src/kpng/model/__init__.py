"""The global model: Kubernetes objects as kpng keeps them, and the wire messages. Pure."""
