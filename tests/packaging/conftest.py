"""The packaging tier: what kpng ships and how it is documented, checked as a user meets it: the
sdist and the wheel (``python -m build``, then a fresh virtualenv), the OCI image, the Helm chart
(with helm, built from its Go module by ``rig.chart``), the docs site (mkdocs) and the README,
the Makefile's targets, the examples and the tutorial, and the eBPF object against its source
(clang). Needs no root but for one image test (containerd); each test skips alone, naming the
tool it lacks, as the tools differ from test to test."""
