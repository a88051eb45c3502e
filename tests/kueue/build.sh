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
# shellcheck source=../gomodule/install.sh
source "$here/../gomodule/install.sh"
install_from_module kueue "$MODULE" "cmd/kueue" "$KUEUE_VERSION" kueue config/components/crd/bases 'kueue.x-k8s.io_*.yaml'
