#!/usr/bin/env bash
# Builds the real control plane used by the tests (etcd, kube-apiserver, kubectl) from the
# Go module beside this script, into .cache/controlplane/<kubernetes version>/bin/.
#
# The build is skipped when the binaries for the pinned version already exist and were built
# from the same go.mod/go.sum/main packages (a stamp file records their hash). The pinned release is
# the k8s.io/kubernetes line of go.mod: change it there (with the staging replaces) and this
# script rebuilds. Go's usual caches (GOMODCACHE, GOCACHE) are used and reused.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"

die() {
  echo "controlplane: $*" >&2
  exit 1
}

command -v go >/dev/null 2>&1 ||
  die "no Go toolchain on PATH. Install Go 1.26 or newer (https://go.dev/doc/install, or your distribution's golang package), then run 'make controlplane' again."

go_minor="$(go env GOVERSION | sed -E 's/^go1\.([0-9]+).*/\1/')"
[[ "$go_minor" =~ ^[0-9]+$ && "$go_minor" -ge 26 ]] ||
  die "Go $(go env GOVERSION) is too old: the pinned Kubernetes release needs Go 1.26 or newer. Install a newer Go, then run 'make controlplane' again."

version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ { print $2; exit }' "$here/go.mod")"
[[ -n "$version" ]] || die "cannot find the k8s.io/kubernetes version in $here/go.mod"
# v1.37.2 -> major 1, minor 37
major="${version#v}"; major="${major%%.*}"
minor="${version#v*.}"; minor="${minor%%.*}"

dest="$root/.cache/controlplane/$version"
bin="$dest/bin"
binaries=(etcd kube-apiserver kubectl kube-scheduler kube-controller-manager)
stamp_value="$(cat "$here/go.mod" "$here/go.sum" "$here"/cmd/*/main.go | sha256sum | cut -c1-16)"

is_built() {
  local b
  for b in "${binaries[@]}"; do [[ -x "$bin/$b" ]] || return 1; done
  [[ "$(cat "$dest/stamp" 2>/dev/null)" == "$stamp_value" ]]
}

# Silent when there is nothing to do: `make cluster` prints only the two lines to paste.
if is_built; then
  exit 0
fi

mkdir -p "$dest"
# One build at a time per version, even when several `make test` run at once.
exec 9>"$dest/.lock"
flock 9
if is_built; then
  echo "controlplane: $version already built in .cache/controlplane/$version/bin"
  exit 0
fi

# The same version strings a release build stamps, so `kubectl version` and the API
# server's /version report the real release.
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit= -X $pkg.buildDate=$build_date"
done

# Two packages at a time at most: the machines are small and shared.
parallel="${CONTROLPLANE_BUILD_P:-2}"
echo "controlplane: building etcd, kube-apiserver, kubectl, kube-scheduler and kube-controller-manager for Kubernetes $version (first time: several minutes)"
mkdir -p "$bin"
cd "$here"
# A line a minute while a long compile runs, so nobody takes it for a hang.
heartbeat() {
  local what="$1" start=$SECONDS
  while sleep 60; do echo "controlplane: still building $what ($((SECONDS - start))s)"; done
}
for b in "${binaries[@]}"; do
  start=$SECONDS
  heartbeat "$b" &
  beat=$!
  trap 'kill $beat 2>/dev/null || true' EXIT
  go build -trimpath -buildvcs=false -p "$parallel" -ldflags "$ldflags" -o "$bin/.$b.tmp" "./cmd/$b" ||
    die "building $b failed (output above). Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)) and that 'go version' is 1.26 or newer, then run 'make controlplane' again."
  kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null || true
  mv -f "$bin/.$b.tmp" "$bin/$b"
  echo "controlplane: built $b in $((SECONDS - start))s"
done
echo "$stamp_value" >"$dest/stamp"
echo "controlplane: $version ready in .cache/controlplane/$version/bin"
