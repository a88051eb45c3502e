#!/usr/bin/env bash
# Builds the real KubeRay operator (github.com/ray-project/kuberay/ray-operator) from its Go
# module into .cache/kuberay/<version>/bin/ray-operator, and extracts the CRDs of the same
# module version (RayCluster, RayJob, RayService, RayCronJob) into .cache/kuberay/<version>/crds/,
# so the CRDs the ground installs always match the controller that serves them.
#
# It is built with its own go.mod (`go install module@version`, tests/gomodule/install.sh): KubeRay pins other k8s.io
# versions than the control plane's module, so the two are never merged. The pin is the
# KUBERAY_VERSION line below: change it and this script rebuilds. Silent when up to date.
set -euo pipefail

KUBERAY_VERSION=v1.6.2  # the newest v1.6.x the module proxy serves; Kueue v0.17 needs >= v1.6.0
MODULE=github.com/ray-project/kuberay/ray-operator

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../gomodule/install.sh
source "$here/../gomodule/install.sh"
install_from_module kuberay "$MODULE" "" "$KUBERAY_VERSION" ray-operator config/crd/bases 'ray.io_*.yaml'
