# Sourced by tests/kuberay/build.sh and tests/kueue/build.sh: builds one controller from its
# own Go module (`go install module@version`, so its k8s.io pins never mix with the control
# plane's) into .cache/<name>/<version>/bin/, and copies the CRDs of that same module version
# into .cache/<name>/<version>/crds/, so the CRDs the ground installs always match the
# controller that serves them. Silent when up to date; a heartbeat line a minute while it
# compiles.
#
#   install_from_module NAME MODULE PACKAGE VERSION BINARY CRD_DIR CRD_GLOB
#     PACKAGE: the main package, "" for the module root; CRD_DIR: inside the module.
install_from_module() {
  local name=$1 module=$2 package=$3 version=$4 binary=$5 crd_dir=$6 crd_glob=$7
  local root dest start beat moddir
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  dest="$root/.cache/$name/$version"
  die() {
    echo "$name: $*" >&2
    exit 1
  }
  is_built() {
    [[ -x "$dest/bin/$binary" && -n "$(ls "$dest"/crds/$crd_glob 2>/dev/null)" && -f "$dest/stamp" ]]
  }
  if is_built; then
    return 0
  fi
  command -v go >/dev/null 2>&1 ||
    die "no Go toolchain on PATH. Install Go 1.26 or newer (https://go.dev/doc/install), then run 'make $name' again."

  mkdir -p "$dest"
  exec 9>"$dest/.lock"
  flock 9
  if is_built; then
    return 0
  fi

  echo "$name: building $binary $version from its Go module (first time: several minutes)"
  start=$SECONDS
  (while sleep 60; do echo "$name: still building $binary ($((SECONDS - start))s)"; done) &
  beat=$!
  trap 'kill '"$beat"' 2>/dev/null || true' EXIT
  mkdir -p "$dest/bin"
  # GOFLAGS from the environment could carry -mod=vendor or similar: a module@version build
  # takes none of them.
  GOFLAGS= GOBIN="$dest/bin" go install -trimpath -buildvcs=false -p "${CONTROLPLANE_BUILD_P:-2}" \
    -ldflags "-s -w" "$module${package:+/$package}@$version" ||
    die "building $module${package:+/$package}@$version failed (output above). Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)), then run 'make $name' again."
  kill "$beat" 2>/dev/null || true
  echo "$name: built $binary in $((SECONDS - start))s"

  # The CRDs come from the very module version just built (Go's module cache holds its files).
  moddir="$(GOFLAGS= go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
  [[ -d "$moddir/$crd_dir" ]] || die "no $crd_dir in $module@$version ($moddir)"
  rm -rf "$dest/crds" && mkdir -p "$dest/crds"
  cp "$moddir/$crd_dir"/$crd_glob "$dest/crds/"
  chmod u+w "$dest"/crds/*.yaml
  echo "$version" >"$dest/stamp"
  echo "$name: $version ready in .cache/$name/$version ($(ls "$dest/crds" | wc -l) CRDs)"
}
