"""Sources: where the global state comes from."""
