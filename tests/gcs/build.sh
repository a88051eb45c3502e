#!/usr/bin/env bash
# Builds fake-gcs-server, the Google Cloud Storage emulator of the test ground, from the Go
# module beside this script into .cache/gcs/<version>/bin/fake-gcs-server (tests/gomodule/tool.sh).
#
# go.mod pins the release (the `github.com/fsouza/fake-gcs-server` requirement, built through
# its `tool` line). Skipped, silently, when built from the same go.mod/go.sum. To move to
# another release: `go get -tool github.com/fsouza/fake-gcs-server@vX.Y.Z && go mod tidy`
# here, then `make gcs`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../gomodule/tool.sh
source "$here/../gomodule/tool.sh"
build_tool gcs "$here" github.com/fsouza/fake-gcs-server github.com/fsouza/fake-gcs-server fake-gcs-server
