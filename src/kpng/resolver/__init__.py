"""The brain: from the global model to one node's local state. Pure and incremental."""
