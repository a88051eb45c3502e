# Sourced by tests/helmbuild/build.sh, tests/gcs/build.sh and tests/prometheus/build.sh: builds one binary from the Go
# module beside the calling script (its go.mod pins the release through a `tool` line) into
# .cache/<name>/<version>/bin/<binary>. Skipped, silently, when the binary for the pinned
# version exists and was built from the same go.mod/go.sum (a stamp file records their hash);
# a heartbeat line a minute while it compiles. Go's usual caches (GOMODCACHE, GOCACHE) are
# used and reused.
#
#   build_tool NAME DIR MODULE PACKAGE BINARY [LDFLAGS_FUNCTION] [TAGS]
#     DIR: the Go module's folder; MODULE: the requirement whose version is the pin;
#     PACKAGE: the main package to build; LDFLAGS_FUNCTION: prints extra -ldflags (run in DIR,
#     with the version as $1, only when a build is needed; "" for none); TAGS: Go build tags,
#     comma-separated (none when absent).
build_tool() {
  local name=$1 dir=$2 module=$3 package=$4 binary=$5 ldflags_fn=${6:-} tags=${7:-}
  local root version dest bin stamp_value ldflags start beat
  root="$(cd "$dir/../.." && pwd)"
  die() {
    echo "$name: $*" >&2
    exit 1
  }
  command -v go >/dev/null 2>&1 ||
    die "no Go toolchain on PATH. Install Go 1.26 or newer (https://go.dev/doc/install), then run 'make $name' again."

  version="$(awk -v m="$module" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$dir/go.mod")"
  [[ -n "$version" ]] || die "cannot find the $module version in $dir/go.mod"
  dest="$root/.cache/$name/$version"
  bin="$dest/bin"
  stamp_value="$(cat "$dir/go.mod" "$dir/go.sum" | sha256sum | cut -c1-16)"
  is_built() {
    [[ -x "$bin/$binary" && "$(cat "$dest/stamp" 2>/dev/null)" == "$stamp_value" ]]
  }
  if is_built; then
    return 0
  fi

  mkdir -p "$bin"
  # One build at a time per version, even when several `make test` run at once.
  exec 9>"$dest/.lock"
  flock 9
  if is_built; then
    echo "$name: $version already built in .cache/$name/$version/bin"
    return 0
  fi

  cd "$dir"
  ldflags="-s -w"
  if [[ -n "$ldflags_fn" ]]; then
    ldflags+=" $("$ldflags_fn" "$version")"
  fi
  echo "$name: building $binary $version (first time: a few minutes)"
  start=$SECONDS
  # A line a minute while the compile runs, so nobody takes it for a hang.
  (while sleep 60; do echo "$name: still building ($((SECONDS - start))s)"; done) &
  beat=$!
  trap 'kill '"$beat"' 2>/dev/null || true' EXIT
  # Two packages at a time at most: the machines are small and shared. GOFLAGS from the
  # environment could carry -mod=vendor or similar.
  GOFLAGS= CGO_ENABLED=0 go build -trimpath -buildvcs=false -p "${CONTROLPLANE_BUILD_P:-2}" -ldflags "$ldflags" \
    -tags "$tags" -o "$bin/.$binary.tmp" "$package" ||
    die "building $binary failed (output above). Check that the Go module proxy is reachable (GOPROXY=$(go env GOPROXY)) and that 'go version' is 1.26 or newer, then run 'make $name' again."
  mv -f "$bin/.$binary.tmp" "$bin/$binary"
  echo "$stamp_value" >"$dest/stamp"
  echo "$name: built $version in $((SECONDS - start))s into .cache/$name/$version/bin"
}
