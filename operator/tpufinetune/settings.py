"""Operator settings, from environment variables (a ConfigMap or Helm values set them).

| variable | default | meaning |
|---|---|---|
| TPUFT_DASHBOARD_URL | http://{service}.{namespace}.svc:8265 | Ray dashboard address; `{service}`, `{namespace}` and `{cluster}` are filled from the RayCluster's head service. Set a fixed URL to reach a Ray head elsewhere (a port-forward, a local head). |
| TPUFT_RAY_TOKEN_FILE | (none) | file holding the Ray auth token (mount it from a Secret); sent as `Authorization: Bearer` |
| TPUFT_RAY_TOKEN | (none) | the token itself, when a file is not practical |
| TPUFT_POLL_INTERVAL | 5 | seconds between looks at a running job (new log lines wake the loop sooner) |
| TPUFT_PROVISION_TIMEOUT | 1800 | seconds to wait for a RayCluster to become ready before failing and releasing it |
| TPUFT_NAMESPACE | (all) | watch only this namespace |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DASHBOARD_URL = "http://{service}.{namespace}.svc:8265"


@dataclass(frozen=True)
class Settings:
    dashboard_url: str = DEFAULT_DASHBOARD_URL
    ray_token: str = ""
    poll_interval: float = 5.0
    provision_timeout: float = 1800.0
    namespace: str = ""

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Settings":
        env = os.environ if env is None else env
        token = env.get("TPUFT_RAY_TOKEN", "")
        token_file = env.get("TPUFT_RAY_TOKEN_FILE", "")
        if token_file:
            token = Path(token_file).read_text().strip()
        return cls(
            dashboard_url=env.get("TPUFT_DASHBOARD_URL") or DEFAULT_DASHBOARD_URL,
            ray_token=token,
            poll_interval=float(env.get("TPUFT_POLL_INTERVAL") or 5.0),
            provision_timeout=float(env.get("TPUFT_PROVISION_TIMEOUT") or 1800.0),
            namespace=env.get("TPUFT_NAMESPACE", ""),
        )

    def dashboard_for(self, cluster: str, namespace: str, service: str) -> str:
        return self.dashboard_url.format(cluster=cluster, namespace=namespace, service=service)

    def ray_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.ray_token}"} if self.ray_token else {}
