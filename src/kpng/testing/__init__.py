"""The backend author's test library, shipped in the wheel (``pip install 'kpng[testing]'``).

- ``kpng.testing.conformance``: the conformance suite a kernel backend should pass, with packets;
- ``kpng.testing.netns``: a cluster of network namespaces (nodes, pods, an external client);
- ``kpng.testing.states``: node-local states to feed a backend, and ``recording``: kpng in
  process with a backend that records what it is given;
- ``echo``, ``probe`` and ``waiting``: what those are built from.
- ``relay``: a relay that counts each connection's bytes, what a watch costs on the wire.

No cluster and no API server: the project's own real-cluster harness is ``rig``, which
the wheel does not ship.
"""
