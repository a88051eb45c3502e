"""Root conftest: shared fixtures come from the harness plugins.

`tests/` is on sys.path (pytest's rootdir-relative import), so `harness` imports directly.
"""
# session_order first: the fixture plugins import it, and it must be rewritten before that.
pytest_plugins = ["harness.session_order", "harness.k8s_fixtures", "harness.ray_fixtures",
                  "harness.ground_fixtures", "harness.kueue_fixtures", "harness.gcs_fixtures"]
