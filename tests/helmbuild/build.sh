#!/usr/bin/env bash
# Builds helm (the Helm 3 CLI) for the chart tests from the Go module beside this script,
# into .cache/helm/<helm version>/bin/helm (tests/gomodule/tool.sh).
#
# go.mod pins the release (the `helm.sh/helm/v3` requirement, built through its `tool`
# line). The build is skipped when the binary for the pinned version exists and was built
# from the same go.mod/go.sum (a stamp file records their hash). To move to another
# release: `go get -tool helm.sh/helm/v3/cmd/helm@vX.Y.Z && go mod tidy` here, then
# `make helm`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# What helm's own Makefile stamps: the release, and the Kubernetes minor its client
# libraries come from (the default for .Capabilities.KubeVersion and the deprecation lint).
helm_ldflags() {
  local version=$1 k8s k8s_minor flags pkg
  k8s="$(go list -m -f '{{.Version}}' k8s.io/client-go)"  # v0.37.0 -> Kubernetes 1.37
  k8s_minor="${k8s#v0.}"; k8s_minor="${k8s_minor%%.*}"
  flags="-X helm.sh/helm/v3/internal/version.version=$version -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    flags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
  done
  echo "$flags"
}

# shellcheck source=../gomodule/tool.sh
source "$here/../gomodule/tool.sh"
build_tool helm "$here" helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm helm helm_ldflags
