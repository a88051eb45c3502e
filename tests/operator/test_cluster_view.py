"""How KubeRay's RayCluster status is read: readiness, problems, ownership, dashboard URL."""

from tpufinetune.adapters.kube import cluster_view
from tpufinetune.settings import Settings


def raycluster(status: dict | None = None, owner_uid: str = "uid-1") -> dict:
    return {
        "metadata": {"name": "tft-demo", "namespace": "team-a", "ownerReferences": [{"uid": owner_uid}]},
        "status": status or {},
    }


def test_missing_cluster():
    assert cluster_view(None, "uid-1", Settings()).exists is False


def test_ready_state_and_default_dashboard_from_the_head_service():
    view = cluster_view(raycluster({"state": "ready", "head": {"serviceName": "tft-demo-head-svc"}}), "uid-1", Settings())
    assert view.exists and view.owned and view.ready
    assert view.dashboard_url == "http://tft-demo-head-svc.team-a.svc:8265"


def test_ready_from_conditions_when_state_is_absent():
    conditions = [{"type": "HeadPodReady", "status": "True"}, {"type": "RayClusterProvisioned", "status": "True"}]
    assert cluster_view(raycluster({"conditions": conditions}), "uid-1", Settings()).ready


def test_replica_failure_is_a_problem_not_readiness():
    conditions = [{"type": "RayClusterReplicaFailure", "status": "True", "message": "pods \"w-0\" is forbidden: exceeded quota"}]
    view = cluster_view(raycluster({"conditions": conditions}), "uid-1", Settings())
    assert not view.ready
    assert "exceeded quota" in view.problem


def test_someone_elses_cluster_is_not_owned():
    assert not cluster_view(raycluster({"state": "ready"}, owner_uid="other"), "uid-1", Settings()).owned


def test_dashboard_url_setting_overrides_the_service_address():
    settings = Settings.from_env({"TPUFT_DASHBOARD_URL": "http://127.0.0.1:8265"})
    assert cluster_view(raycluster({"state": "ready"}), "uid-1", settings).dashboard_url == "http://127.0.0.1:8265"
    template = Settings.from_env({"TPUFT_DASHBOARD_URL": "https://{cluster}.{namespace}.example.com"})
    assert cluster_view(raycluster({"state": "ready"}), "uid-1", template).dashboard_url == "https://tft-demo.team-a.example.com"


def test_token_file_becomes_a_bearer_header(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    settings = Settings.from_env({"TPUFT_RAY_TOKEN_FILE": str(token)})
    assert settings.ray_headers() == {"Authorization": "Bearer s3cret"}
    assert Settings.from_env({}).ray_headers() == {}

