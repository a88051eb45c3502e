#!/usr/bin/env bash
# Builds the real Kueue controller manager (sigs.k8s.io/kueue/cmd/kueue) from its Go module
# into .cache/kueue/<version>/bin/kueue, and extracts the CRDs of the same module version into
# .cache/kueue/<version>/crds/, so the CRDs the ground installs always match the controller.
#
# Like tests/kuberay/build.sh it is built with its own go.mod (`go install module@version`):
# Kueue pins its own k8s.io versions, never merged with the control plane's module. The pin is
# the KUEUE_VERSION line below: change it and this script rebuilds. Silent when up to date.
set -euo pipefail

KUEUE_VERSION=v0.17.0  # manages ray.io/raycluster with KubeRay >= v1.6.0 (the ground runs v1.6.2)
MODULE=sigs.k8s.io/kueue

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="$root/.cache/kueue/$KUEUE_VERSION"

die() {
  echo "kueue: $*" >&2
  exit 1
}

is_built() {
  [[ -x "$dest/bin/kueue" && -f "$dest/crds/kueue.x-k8s.io_workloads.yaml" && -f "$dest/stamp" ]]
}
if is_built; then
  exit 0
fi
command -v go >/dev/null 2>&1 ||
  die "no Go toolchain on PATH. Install Go 1.26 or newer (https://go.dev/doc/install), then run 'make kueue' again."

mkdir -p "$dest"
exec 9>"$dest/.lock"
flock 9
if is_built; then
  exit 0
fi

echo "kueue: building kueue $KUEUE_VERSION from its Go module (first time: several minutes)"
start=$SECONDS
(while sleep 60; do echo "kueue: still building kueue ($((SECONDS - start))s)"; done) &
beat=$!
trap 'kill $beat 2>/dev/null || true' EXIT
mkdir -p "$dest/bin"
# GOFLAGS from the environment could carry -mod=vendor or similar: a module@version build
# takes none of them.
GOFLAGS= GOBIN="$dest/bin" go install -trimpath -buildvcs=false -p "${CONTROLPLANE_BUILD_P:-2}" \
  -ldflags "-s -w" "$MODULE/cmd/kueue@$KUEUE_VERSION" ||
  die "building $MODULE/cmd/kueue@$KUEUE_VERSION failed (output above). Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)), then run 'make kueue' again."
kill "$beat" 2>/dev/null || true
echo "kueue: built kueue in $((SECONDS - start))s"

# The CRDs come from the very module version just built (Go's module cache holds its files).
moddir="$(GOFLAGS= go mod download -json "$MODULE@$KUEUE_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
crd_dir="$moddir/config/components/crd/bases"
[[ -d "$crd_dir" ]] || die "no config/components/crd/bases in $MODULE@$KUEUE_VERSION ($moddir)"
rm -rf "$dest/crds" && mkdir -p "$dest/crds"
cp "$crd_dir"/kueue.x-k8s.io_*.yaml "$dest/crds/"
chmod u+w "$dest"/crds/*.yaml
echo "$KUEUE_VERSION" >"$dest/stamp"
echo "kueue: $KUEUE_VERSION ready in .cache/kueue/$KUEUE_VERSION ($(ls "$dest/crds" | wc -l) CRDs)"
