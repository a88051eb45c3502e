"""The operator's end-to-end tests run on the test ground (tests/harness/ground.py): the real
KubeRay turns each RayCluster into pods, the scheduler binds them to GKE-shaped nodes, the
node agent runs them as Ray processes, and the operator (as deploy/'s ServiceAccount)
reaches each head by its Service name. Fixtures: `ground`, `operator`, `kube`
(tests/harness/ground_fixtures.py)."""
