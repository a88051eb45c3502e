#!/usr/bin/env bash
# Builds Prometheus, the metrics server of the dashboard test (tests/operator/
# test_dashboard_e2e.py), from the Go module beside this script into
# .cache/prometheus/<version>/bin/prometheus (tests/gomodule/tool.sh).
#
# go.mod pins the release (the `github.com/prometheus/prometheus` requirement, built through
# its `tool` line; module v0.316.0 is Prometheus 3.16.0). It is built with the build tag
# `remove_all_sd`: Prometheus registers every service discovery (Kubernetes, the clouds,
# Consul, ...) from plugins/plugin_*.go files that this tag leaves out, which drops most of
# the build; the test scrapes fixed targets (static_configs), which stay. The web UI's assets
# are not built in either (no `builtinassets` tag): the HTTP API the test queries is all
# there. Skipped, silently, when built from the same go.mod/go.sum. To move to another
# release: `go get -tool github.com/prometheus/prometheus/cmd/prometheus@v0.X.Y && go mod tidy`
# here, then `make prometheus`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# What Prometheus' own build (promu) stamps into github.com/prometheus/common/version, shown by
# `prometheus --version` and /api/v1/status/buildinfo: module v0.X.Y is release 3.X.Y.
prometheus_ldflags() {
  local version=$1 minor patch
  minor="${version#v0.}"; minor="${minor%%.*}"; minor="${minor#3}"; minor="${minor#0}"
  patch="${version##*.}"
  echo "-X github.com/prometheus/common/version.Version=3.${minor:-0}.$patch -X github.com/prometheus/common/version.Branch=release -X github.com/prometheus/common/version.BuildUser=tpufinetune"
}

# shellcheck source=../gomodule/tool.sh
source "$here/../gomodule/tool.sh"
build_tool prometheus "$here" github.com/prometheus/prometheus github.com/prometheus/prometheus/cmd/prometheus \
  prometheus prometheus_ldflags remove_all_sd
