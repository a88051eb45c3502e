#!/usr/bin/env bash
# Builds helm (the Helm 3 CLI) for the chart tests from the Go module beside this script,
# into .cache/helm/<helm version>/bin/helm.
#
# go.mod pins the release (the `helm.sh/helm/v3` requirement, built through its `tool`
# line). The build is skipped when the binary for the pinned version exists and was built
# from the same go.mod/go.sum (a stamp file records their hash). To move to another
# release: `go get -tool helm.sh/helm/v3/cmd/helm@vX.Y.Z && go mod tidy` here, then
# `make helm`. Go's usual caches (GOMODCACHE, GOCACHE) are used and reused.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"

die() {
  echo "helm: $*" >&2
  exit 1
}

command -v go >/dev/null 2>&1 ||
  die "no Go toolchain on PATH. Install Go 1.26 or newer (https://go.dev/doc/install), then run 'make helm' again."

version="$(awk '$1 == "helm.sh/helm/v3" && $2 ~ /^v/ { print $2; exit }' "$here/go.mod")"
[[ -n "$version" ]] || die "cannot find the helm.sh/helm/v3 version in $here/go.mod"

dest="$root/.cache/helm/$version"
bin="$dest/bin"
stamp_value="$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-16)"

is_built() {
  [[ -x "$bin/helm" && "$(cat "$dest/stamp" 2>/dev/null)" == "$stamp_value" ]]
}

# Silent when there is nothing to do.
if is_built; then
  exit 0
fi

mkdir -p "$bin"
# One build at a time per version, even when several `make test` run at once.
exec 9>"$dest/.lock"
flock 9
if is_built; then
  echo "helm: $version already built in .cache/helm/$version/bin"
  exit 0
fi

cd "$here"
# What helm's own Makefile stamps: the release, and the Kubernetes minor its client
# libraries come from (the default for .Capabilities.KubeVersion and the deprecation lint).
k8s="$(go list -m -f '{{.Version}}' k8s.io/client-go)"  # v0.37.0 -> Kubernetes 1.37
k8s_minor="${k8s#v0.}"; k8s_minor="${k8s_minor%%.*}"
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done

# Two packages at a time at most: the machines are small and shared.
parallel="${HELM_BUILD_P:-2}"
echo "helm: building helm $version (first time: a few minutes)"
start=$SECONDS
# A line a minute while the compile runs, so nobody takes it for a hang.
(while sleep 60; do echo "helm: still building ($((SECONDS - start))s)"; done) &
beat=$!
trap 'kill $beat 2>/dev/null || true' EXIT
CGO_ENABLED=0 go build -trimpath -p "$parallel" -ldflags "$ldflags" -o "$bin/.helm.tmp" helm.sh/helm/v3/cmd/helm ||
  die "building helm failed (output above). Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)) and that 'go version' is 1.26 or newer, then run 'make helm' again."
mv -f "$bin/.helm.tmp" "$bin/helm"
echo "$stamp_value" >"$dest/stamp"
echo "helm: built $version in $((SECONDS - start))s into .cache/helm/$version/bin"
