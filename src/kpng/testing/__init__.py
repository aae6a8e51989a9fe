"""Reusable test harnesses: a real control plane (kube-apiserver and etcd) and its pytest fixtures.

``kpng.testing.cluster`` builds and runs the control plane; ``kpng.testing.kubeapi`` is a small
client to create objects in it; ``kpng.testing.fixtures`` is a pytest plugin
(``pytest_plugins = ["kpng.testing.fixtures"]``) with a session-scoped control plane.
"""
