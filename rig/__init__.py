"""kpng's own real-cluster harness: what its tests, benchmarks and e2e runs stand on.

A real control plane built from the Kubernetes Go modules (``cluster``, its pytest plugin
``fixtures`` and the small client ``kubeapi``), real nodes with kubelets and containerd
(``nodes``, ``images``, ``addons``), upstream's e2e suite (``e2e``), the supported releases
(``compat``) and connections' bytes as the kernel counts them (``tcpinfo``).

It stays out of the wheel: it builds and runs Kubernetes as root on the machine it is on, which
is the project's test rig, not an API for kpng's users, and it changes with every Kubernetes
release. A backend author's test library is ``kpng.testing``.
"""
