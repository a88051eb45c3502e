"""deploy/samples/ as a ground user applies them."""

from __future__ import annotations

from pathlib import Path

import yaml

SAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "samples"


def sample_on_the_ground(kube, ground, sample: str) -> dict:
    """A tutorial sample as a ground user applies it: PROJECT and BUCKET filled in (the
    image's repository, `trainer`, is the trainer image's environment on the ground; the
    bucket is the ground's Cloud Storage), and the Hugging Face token Secret it names
    created in the namespace. Nothing else of it changes."""
    text = (SAMPLES / sample).read_text().replace("PROJECT", "ground-project").replace("BUCKET", ground.gcs.bucket)
    manifest = yaml.safe_load(text)
    token = manifest["spec"]["model"]["tokenSecret"]
    kube.kubectl("create", "secret", "generic", token["name"], f"--from-literal={token['key']}=hf_ground_token")
    return manifest
