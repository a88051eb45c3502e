#!/usr/bin/env bash
# Builds the real KubeRay operator (github.com/ray-project/kuberay/ray-operator) from its Go
# module into .cache/kuberay/<version>/bin/ray-operator, and extracts the CRDs of the same
# module version (RayCluster, RayJob, RayService, RayCronJob) into .cache/kuberay/<version>/crds/,
# so the CRDs the ground installs always match the controller that serves them.
#
# It is built with its own go.mod (`go install module@version`): KubeRay pins other k8s.io
# versions than the control plane's module, so the two are never merged. The pin is the
# KUBERAY_VERSION line below: change it and this script rebuilds. Silent when up to date.
set -euo pipefail

KUBERAY_VERSION=v1.6.2  # the newest v1.6.x the module proxy serves; Kueue v0.17 needs >= v1.6.0
MODULE=github.com/ray-project/kuberay/ray-operator

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="$root/.cache/kuberay/$KUBERAY_VERSION"

die() {
  echo "kuberay: $*" >&2
  exit 1
}

is_built() {
  [[ -x "$dest/bin/ray-operator" && -f "$dest/crds/ray.io_rayclusters.yaml" && -f "$dest/stamp" ]]
}
if is_built; then
  exit 0
fi
command -v go >/dev/null 2>&1 ||
  die "no Go toolchain on PATH. Install Go 1.26 or newer (https://go.dev/doc/install), then run 'make kuberay' again."

mkdir -p "$dest"
exec 9>"$dest/.lock"
flock 9
if is_built; then
  exit 0
fi

echo "kuberay: building ray-operator $KUBERAY_VERSION from its Go module (first time: a few minutes)"
start=$SECONDS
(while sleep 60; do echo "kuberay: still building ray-operator ($((SECONDS - start))s)"; done) &
beat=$!
trap 'kill $beat 2>/dev/null || true' EXIT
mkdir -p "$dest/bin"
# GOFLAGS from the environment could carry -mod=vendor or similar: a module@version build
# takes none of them.
GOFLAGS= GOBIN="$dest/bin" go install -trimpath -buildvcs=false -p "${CONTROLPLANE_BUILD_P:-2}" \
  -ldflags "-s -w" "$MODULE@$KUBERAY_VERSION" ||
  die "building $MODULE@$KUBERAY_VERSION failed (output above). Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)), then run 'make kuberay' again."
kill "$beat" 2>/dev/null || true
echo "kuberay: built ray-operator in $((SECONDS - start))s"

# The CRDs come from the very module version just built (Go's module cache holds its files).
moddir="$(GOFLAGS= go mod download -json "$MODULE@$KUBERAY_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[[ -d "$moddir/config/crd/bases" ]] || die "no config/crd/bases in $MODULE@$KUBERAY_VERSION ($moddir)"
rm -rf "$dest/crds" && mkdir -p "$dest/crds"
cp "$moddir"/config/crd/bases/ray.io_*.yaml "$dest/crds/"
chmod u+w "$dest"/crds/*.yaml
echo "$KUBERAY_VERSION" >"$dest/stamp"
echo "kuberay: $KUBERAY_VERSION ready in .cache/kuberay/$KUBERAY_VERSION ($(ls "$dest/crds" | wc -l) CRDs)"
