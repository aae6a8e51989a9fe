# Everything runs from a project-local virtualenv that these targets create on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: example test lint typecheck unit control-plane real-nodes protos bench e2e image clean \
	system-packages compat

$(BIN)/kpng: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# Runs kpng on the bundled example cluster and prints node-2's state.
example: $(BIN)/kpng
	$(BIN)/kpng file --input examples/cluster.yaml to-local --node-name node-2 to-json --once --output - \
	  | $(BIN)/python -m json.tool

# The Debian packages the data-plane, conformance and real-node tests need (as root); without
# them `make test` skips those tests and ends with a summary of what it skipped and why.
system-packages:
	tools/install-system-packages

# The whole suite: lint, types, layer contracts, tests.
test: lint typecheck unit

lint: $(BIN)/kpng
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(BIN)/kpng
	$(BIN)/mypy

unit: $(BIN)/kpng control-plane real-nodes
	$(BIN)/pytest

# The kube-apiserver and etcd the `apiserver` tests run, and the helm the chart's tests run:
# built with Go on first use (a few minutes), then found in ~/.cache/kpng/control-plane in a moment.
control-plane: $(BIN)/kpng
	$(BIN)/python -m kpng.testing.cluster build

# The API-server tests against every supported Kubernetes release (kpng.testing.cluster's
# SUPPORTED_VERSIONS), or those in VERSIONS (e.g. make compat VERSIONS=v1.34.4): each control
# plane is built on first use (a few minutes), then cached.
compat: $(BIN)/kpng
	$(BIN)/python -m kpng.testing.compat $(VERSIONS)

# Upstream's [sig-network] proxy tests on two real nodes, with kpng and then with kube-proxy
# (needs root; about 30 minutes on two cores). Results in e2e-results/, the table in summary.md.
# SHAPE: how kpng is deployed: daemonset (one process per node), sidecar (a brain and a backend
# per node) or central (brains in a Deployment, a backend per node).
SHAPE ?= daemonset
e2e: $(BIN)/kpng
	$(BIN)/python -m kpng.testing.e2e --shape $(SHAPE) --report-dir e2e-results

# kpng's image as an OCI archive, built without a registry (see deploy/build-image).
image: $(BIN)/kpng
	$(BIN)/python -m kpng.testing.images kpng --output kpng.oci.tar

# What the real-node tests run: kubelet, controllers, kubectl, agnhost, CoreDNS (Go builds,
# cached beside the control plane) and the images (Debian packages). Skipped without root,
# containerd, runc, mmdebstrap or the CNI plugins, as those tests are.
real-nodes: $(BIN)/kpng
	$(BIN)/python -m kpng.testing.nodes build

# Regenerates the Python code of the .proto files under src/kpng/api.
protos: $(BIN)/kpng
	$(BIN)/python -m grpc_tools.protoc -I src \
	  --plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	  --python_out=src --mypy_out=src --grpc_python_out=src --mypy_grpc_out=src \
	  src/kpng/api/localv1.proto src/kpng/api/globalv1.proto src/kpng/api/batchv1.proto \
	  src/kpng/api/pluginv1.proto

bench: $(BIN)/kpng
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
