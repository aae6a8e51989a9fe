# Everything runs from a project-local virtualenv that these targets create on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: example dev check test lint typecheck unit control-plane real-nodes protos bench e2e image clean docs bpf-object \
	system-packages system-packages-as-root compat

# Two stamps, so that `make example` installs what kpng needs to run (120 MB) and no more:
# $(BIN)/kpng is the runtime install, $(DEV) adds the test, lint and build tools (`.[dev]`, 264 MB
# in all) that every other target needs. `make example` then `make test` in one tree only adds
# the tools; a target of either kind on a fresh tree makes what it needs.
DEV := $(VENV)/.dev-installed
# kpng's bytecode, as a wheel install has it: the editable install has none, and where
# PYTHONDONTWRITEBYTECODE is set every kpng process would compile its modules anew (0.2 s each).
COMPILE := $(BIN)/python -m compileall -q src/kpng

$(BIN)/kpng: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

# The project's real-cluster rig (rig/) is the repository's, not the wheel's: a .pth file puts
# the repository's root on the development venv's path, so that tests, benches and
# `python -m rig.cluster` find it from any directory.
$(DEV): $(BIN)/kpng
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/python -c 'import pathlib, site; pathlib.Path(site.getsitepackages()[0], "kpng-rig.pth").write_text(str(pathlib.Path.cwd()) + "\n")'
	touch $@

# kpng with its development tools (pytest, ruff, mypy, build...), without running anything.
dev: $(DEV)

# Runs kpng on the bundled example cluster and prints node-2's state.
example: $(BIN)/kpng
	@$(COMPILE)
	$(BIN)/kpng file --input examples/cluster.yaml to-local --node-name node-2 to-json --once --output - \
	  | $(BIN)/python -m json.tool

# The Debian packages the data-plane, conformance and real-node tests need (as root); without
# them `make test` skips those tests and ends with a summary of what it skipped and why.
system-packages:
	tools/install-system-packages

# `make test` as root installs them itself, before the builds that need them (mmdebstrap for the
# node images), so that a fresh Debian machine needs no step but `make test`.
system-packages-as-root:
	@if [ "$$(id -u)" = 0 ]; then tools/install-system-packages; \
	else echo "not root: the tests that need system packages will be skipped (see the summary)"; fi

# The pure tier alone (tests/pure: no root, no network namespace, no API server, nothing built
# with Go): the quick loop while editing, over every core, without its `slow` tests (kpng
# processes, fuzzing, thousands of generated objects: a tenth of the tests, four fifths of the
# tier's CPU), which `make test` runs. tests/<tier>/conftest.py says what
# each tier needs.
check: $(DEV)
	@$(COMPILE)
	$(BIN)/pytest tests/pure -n auto -m "not slow"

# The whole suite: lint, types, layer contracts, tests (every tier).
test: lint typecheck unit

lint: $(DEV)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(DEV)
	$(BIN)/mypy

unit: $(DEV) system-packages-as-root control-plane real-nodes
	@$(COMPILE)
	$(BIN)/pytest

# The kube-apiserver and etcd the `apiserver` tests run, and the helm the chart's tests run:
# built with Go on first use (a few minutes), then found in ~/.cache/kpng/control-plane in a moment.
control-plane: $(DEV)
	$(BIN)/python -m rig.cluster build
	$(BIN)/python -m rig.chart build

# The API-server tests against every supported Kubernetes release (rig.cluster's
# SUPPORTED_VERSIONS), or those in VERSIONS (e.g. make compat VERSIONS=v1.34.4): each control
# plane is built on first use (a few minutes), then cached.
compat: $(DEV)
	$(BIN)/python -m rig.compat $(VERSIONS)

# Upstream's [sig-network] proxy tests on two real nodes, with kpng and then with kube-proxy
# (needs root; about 30 minutes on two cores). Results in e2e-results/, the table in summary.md.
# SHAPE: how kpng is deployed: daemonset (one process per node), sidecar (a brain and a backend
# per node) or central (brains in a Deployment, a backend per node).
# MODE: kube-proxy's mode in both proxies' configuration (nftables or iptables), or ebpf: kpng
# with to-ebpf, judged against kube-proxy's nftables mode.
# DUAL_STACK=1: upstream's [Feature:IPv6DualStack] tests instead, on a dual-stack cluster.
SHAPE ?= daemonset
MODE ?= nftables
DUAL_STACK ?=
e2e: $(DEV)
	$(BIN)/python -m rig.e2e --shape $(SHAPE) --mode $(MODE) $(if $(DUAL_STACK),--dual-stack-suite )--report-dir e2e-results

# kpng's image as an OCI archive, built without a registry (see deploy/build-image).
image: $(DEV)
	$(BIN)/python -m rig.images kpng --output kpng.oci.tar

# What the real-node tests run: kubelet, controllers, kubectl, agnhost, CoreDNS (Go builds,
# cached beside the control plane) and the images (Debian packages). Skipped without root,
# containerd, runc, mmdebstrap or the CNI plugins, as those tests are.
real-nodes: $(DEV)
	$(BIN)/python -m rig.nodes build

# Regenerates the Python code of the .proto files under src/kpng/api.
protos: $(DEV)
	$(BIN)/python -m grpc_tools.protoc -I src \
	  --plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	  --python_out=src --mypy_out=src --grpc_python_out=src --mypy_grpc_out=src \
	  src/kpng/api/localv1.proto src/kpng/api/globalv1.proto src/kpng/api/batchv1.proto \
	  src/kpng/api/pluginv1.proto

# Recompiles to-ebpf's programs into the object kpng ships (src/kpng/backends/ebpf/sockets.bpf.o)
# and its manifest, after a change to sockets.bpf.c: needs clang and libbpf-dev, which nothing
# else does (tests/packaging/test_ebpf_object.py fails until this is run and the result committed).
bpf-object: $(BIN)/kpng
	$(BIN)/python -m kpng.backends.ebpf.toolchain --regenerate

bench: $(DEV)
	$(BIN)/python bench/run_all.py

# docs/ as a site in site/ (mkdocs.yml has the nav by audience); `make test` builds it too
# (tests/packaging/test_docs.py), so that a broken link fails. `.venv/bin/mkdocs serve` to read it.
docs: $(DEV)
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache site
