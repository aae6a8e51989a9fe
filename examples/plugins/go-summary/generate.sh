#!/bin/sh
# Generates kpng/ (the plugin API's Go code) from kpng's .proto files: the command
# docs/backends/plugins.md gives. Needs protoc (Debian's protobuf-compiler, or
# `python -m grpc_tools.protoc` from pip's grpcio-tools), and Go's two protoc plugins on PATH:
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
#   go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.0
# PROTOC overrides the protoc command; KPNG_PROTOS the directory holding kpng/api/*.proto.
set -eu
cd "$(dirname "$0")"
protos=${KPNG_PROTOS:-../../../src}
${PROTOC:-protoc} -I "$protos" \
  --go_out=kpng --go_opt=module=kpng \
  --go-grpc_out=kpng --go-grpc_opt=module=kpng \
  kpng/api/localv1.proto kpng/api/pluginv1.proto
