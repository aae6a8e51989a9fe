"""The gRPC watch servers (``to-api``): localv1, globalv1 and kpng's batched watch."""
