"""kpng: a pluggable Kubernetes service proxy."""

__version__ = "0.1.0"
