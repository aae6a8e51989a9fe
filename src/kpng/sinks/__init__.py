"""Sinks: where the global state goes."""
