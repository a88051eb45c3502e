# All set-up happens here, so a fresh clone needs only `make demo` or `make test`.
SHELL := /bin/bash
VENV := .venv
PYTHON := $(VENV)/bin/python
PIP_STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# The suite runs on Python 3.11 (its locks, the images, CI): python3.11 on PATH, else
# pyenv's newest 3.11, never whatever python3 happens to be.
PYTHON311 := $(or $(shell command -v python3.11 2>/dev/null),$(lastword $(sort $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.11*/bin/python3.11))))
NO_PYTHON311 := make: the suite runs on Python 3.11, and there is none here (no python3.11 on PATH, no pyenv 3.11): install it (pyenv install 3.11, or the python3.11 package of the distribution), then run make again

.PHONY: venv python311 previous-release controlplane kuberay kueue gcs prometheus images ground helm go-tools prepare test test-fast crds dashboards demo cluster cluster-down bench lint clean

## Python environment: pinned stack from pyproject.toml (pip's cache keeps re-runs fast).
$(PIP_STAMP): pyproject.toml | python311
	@if [ -x $(PYTHON) ] && ! $(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then \
		echo "$(VENV) is not Python 3.11: making it anew with $(PYTHON311)"; rm -rf $(VENV); fi
	test -x $(PYTHON) || $(PYTHON311) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e '.[operator,train,test]'
	rm -f $(VENV)/.installed-* && touch $@

venv: $(PIP_STAMP)

python311:
	@test -n "$(PYTHON311)" || { echo '$(NO_PYTHON311)' >&2; exit 1; }

## The previous release's commit, for the upgrade test: a shallow clone (CI's) lacks it, so
## it is fetched from the clone's remote, that commit alone (tests/harness/previous_release.py).
## A clone it cannot be had in still runs every other test: the upgrade test then fails
## with the sentence this prints.
previous-release: python311
	@$(PYTHON311) tests/harness/previous_release.py || echo "make: going on without the previous release; tests/operator/test_upgrade_e2e.py will fail until it is fetched" >&2

## Real kube-apiserver, etcd and kubectl built from Go modules (rebuilt only when the pin changes).
controlplane:
	@bash tests/controlplane/build.sh

## The KubeRay operator and its CRDs, from the pinned ray-operator Go module (its own build).
kuberay:
	@bash tests/kuberay/build.sh

## Kueue's controller manager and its CRDs, from the pinned sigs.k8s.io/kueue module (its own
## build); the ground starts it only for the tests that queue RayClusters.
kueue:
	@bash tests/kueue/build.sh

## fake-gcs-server, the ground's Google Cloud Storage emulator, from its pinned Go module.
gcs:
	@bash tests/gcs/build.sh

## Prometheus, which scrapes the operator in the dashboard test, from its pinned Go module
## (built without service discovery: the test's targets are static).
prometheus:
	@bash tests/prometheus/build.sh

## The trainer image's environment, built as Dockerfile.trainer builds it (the hashed lock,
## torch_tpu, the project installed as a copy): pods of the trainer image run it.
images: venv
	@$(PYTHON) tests/harness/images.py

## Everything the test ground runs (control plane, scheduler, controller-manager, KubeRay, Kueue,
## the GCS emulator, Prometheus, the trainer image).
ground: controlplane kuberay kueue gcs prometheus images

## helm, for the chart tests (tests/deploy), built from Go modules (rebuilt only when the pin changes).
helm:
	@bash tests/helmbuild/build.sh

## The whole stack locally on the test ground: KubeRay, scheduler, GKE-shaped nodes whose
## pods are Ray processes, the operator, and the sample CPU rehearsal run to Succeeded.
demo: venv ground
	$(PYTHON) scripts/demo.py

## Regenerate crds/ from the pydantic models.
crds: venv
	$(PYTHON) -m tpufinetune.crdgen --out crds/

## Regenerate the Grafana dashboard (deploy/grafana and the chart's copy) from
## operator/tpufinetune/dashboard.py.
dashboards: venv
	$(PYTHON) -m tpufinetune.dashboard --out deploy/

## Everything: unit, control-plane, Ray and end-to-end tests. Non-zero on any failure
## (pytest's "no tests collected", exit 5, included). Two lanes at once: the ground's tests
## in one worker, all others in the other (tests/harness/session_order.py).
test: prepare
	$(PYTHON) -m pytest -n 2 --dist loadgroup

## The Go programs one after another (each build takes every core by itself; make says it
## resets its jobserver for this one).
go-tools:
	@$(MAKE) --no-print-directory -j1 controlplane kuberay kueue gcs prometheus helm

## What the suite needs, with pip's side (the venv, then the trainer and operator images'
## environments) beside the Go builds: on a fresh machine both wait on downloads for minutes.
prepare: previous-release
	@$(MAKE) --no-print-directory -j2 images go-tools

## Pure-core tests only (milliseconds; no control plane, no Ray).
test-fast: venv
	$(PYTHON) -m pytest -m "not cluster and not ray and not slow"

## The test ground and the operator in the background; prints the lines to paste.
cluster: venv ground
	@$(PYTHON) tests/harness/supervisor.py up

## Stopping needs no up-to-date environment: a changed pyproject.toml (a reinstall, which
## can fail offline) must never keep a running ground from being stopped.
cluster-down:
	@if [ -x $(PYTHON) ]; then $(PYTHON) tests/harness/supervisor.py down; else echo "controlplane: not running (no $(VENV))"; fi

clean:
	rm -rf .cache build dist *.egg-info
