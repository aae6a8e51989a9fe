"""Backends: one package per backend, each registering its ``to-<name>`` command.

Built-in backends are the packages beside this file; third-party ones declare an entry point in
the ``kpng.backends`` group whose module calls ``register``. Either way the CLI finds ``to-<name>``
without an edit, and imports only the backend it runs.
"""
