"""Nodes of the test ground fail as GKE nodes do (harness/nodelife.py, Ground's node API).

Pure: a TPU worker's id and slice come from KubeRay's replica and host index labels, as GKE's
TPU webhook reads them; a Spot pool carries GKE's label and taint; a pod shut down with its
node is reported as the kubelet reports it.

On the ground (two runs, each proving several things):
- A node killed under a cpu run: it goes NotReady with the `unreachable` taints, its pods are
  evicted by the real taint-eviction controller, and once GKE would have deleted the Node the
  pod garbage collector removes them; KubeRay makes the lost pods again on other nodes and Ray
  Train (maxFailures) restarts its workers from the last checkpoint: the run ends Succeeded.
  The run is preference tuning with LoRA (`training.method: dpo` with `training.lora`, on
  pairs made from the ground's rows and read from the bucket): its checkpoints hold the
  adapter only, each epoch's DPO rewards, margin and accuracy (training and held-out pairs)
  are in status.history[].dpo, and its two exports (the PEFT adapter, the merged model) load
  back and agree.
- A run whose worker is on a Spot node: the node's scheduled-maintenance label is visible, a
  drain is refused by the worker's PodDisruptionBudget, and a preemption runs the worker's
  preStop hook then SIGTERM (Ray's own handler stops its processes at once; SIGKILL would
  come after the pod's 15 s share of the notice) and the Failed/Terminated status of
  graceful node shutdown, before the node
  goes away. The pool refills the node, and the run ends Succeeded: its first attempt
  `Preempted`, with at most the step in flight lost (its preStop hook saved the step), the
  next one resumed from that checkpoint. The same run evaluates: each epoch's generation
  metrics (status.history[].eval), lm-eval on its export with a custom task from the bucket
  (status.evaluation), and its TensorBoard event files, read back from the bucket with
  TensorBoard's own reader, hold every epoch's loss once and every step's loss once across
  the two attempts' folders: attempt 1's up to the step its notice checkpoint held, attempt
  2's from the next. With compile on, the retry starts warm, as status.attempts[].startup
  says: its compiled graphs from the compile cache the run keeps in its storage; both
  attempts' seconds from submission to first step and where their data came from are
  printed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.kubewatch import KubeWatch
from harness.nodeagent import pod_log_path
from harness.nodelife import SHUTDOWN_MESSAGE, shutdown_status
from harness.nodepools import MAINTENANCE_LABEL, SPOT_TAINT, cpu_pool, node_manifest, tpu_host
from harness.waiting import wait_for
from ground_runs import resource, running, scrape, start_run
from lmeval_ground import check_evaluated, lm_eval_spec, upload_task
from tpufinetune.core.generations import SPOT_LABEL



# ---- pure ----------------------------------------------------------------------------------


def labels(replica: str | None, host: str | None = None) -> dict:
    found = {"ray.io/cluster": "rc", "ray.io/group": "tpu-group"}
    if replica is not None:
        found["ray.io/worker-group-replica-index"] = replica
    if host is not None:
        found["ray.io/replica-host-index"] = host
    return found


def test_a_tpu_workers_id_and_slice_come_from_kuberays_index_labels():
    host = tpu_host(labels("1", "2"), hosts=4)
    assert (host.replica, host.worker_id, host.slice_name) == (1, 2, "tpu-group-1")
    assert host.hostnames == tuple(f"tpu-group-1-{i}.rc-headless-worker-svc" for i in range(4))
    # A replacement pod carries the index of the pod it replaces: the same id, nothing grows.
    assert tpu_host(labels("1", "2"), hosts=4) == host
    single = tpu_host(labels("3"), hosts=1)  # single-host: no host index, no hostnames
    assert (single.worker_id, single.slice_name, single.hostnames) == (0, "tpu-group-3", ())


def test_a_worker_without_kuberays_labels_is_refused_by_name():
    with pytest.raises(ValueError, match="worker-group-replica-index.*RayMultiHostIndexing"):
        tpu_host(labels(None), hosts=1)
    with pytest.raises(ValueError, match="replica-host-index"):
        tpu_host(labels("0"), hosts=4)
    with pytest.raises(ValueError, match="outside a slice of 4"):
        tpu_host(labels("0", "4"), hosts=4)


def test_a_spot_pool_has_gkes_spot_label_and_taint():
    pool = cpu_pool("spot", nodes=1, spot=True)
    node = node_manifest(pool, pool.node_names()[0])
    assert node["metadata"]["labels"][SPOT_LABEL] == "true"
    assert node["spec"]["taints"] == [SPOT_TAINT]
    assert "taints" not in node_manifest(cpu_pool(), "n")["spec"]


class _Container:
    name, image = "ray-worker", "img"


def test_a_pod_shut_down_with_its_node_reads_as_the_kubelet_reports_it():
    status = shutdown_status([_Container()], -15, "2026-01-01T00:00:00Z", restarts=0)["status"]
    assert (status["phase"], status["reason"], status["message"]) == ("Failed", "Terminated", SHUTDOWN_MESSAGE)
    assert status["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 143  # SIGTERM
    target = next(c for c in status["conditions"] if c["type"] == "DisruptionTarget")
    assert (target["status"], target["reason"]) == ("True", "TerminationByKubelet")


# ---- on the ground -------------------------------------------------------------------------


def node_of(ground, name: str) -> dict | None:
    result = ground.kubectl("get", "node", name, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def ready_of(node: dict) -> dict:
    return next(c for c in node["status"]["conditions"] if c["type"] == "Ready")


def pods_by_uid(kube, cluster: str) -> dict[str, dict]:
    return {p["metadata"]["uid"]: p for p in kube.pods_of(cluster)}


def _check_lora_exports(gcs, base_uri: str, storage: str, status: dict, tmp_path) -> None:
    """A LoRA run's checkpoint holds only the adapter and its optimizer state; its adapter
    export loads with peft onto the base the run started from, and gives the merged export's
    logits."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoint, merged_uri = status["checkpointURI"], status["exportedModelURI"]
    adapter_uri = status["exportedAdapterURI"]
    assert checkpoint.startswith(storage + "/") and adapter_uri.startswith(storage + "/"), status
    shard_bytes = sum(len(gcs.read(f"{checkpoint}/{name}")) for name in gcs.list(checkpoint) if name.endswith(".distcp"))
    adapter = gcs.download(adapter_uri, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA", config

    def load(uri: str, name: str):
        return AutoModelForCausalLM.from_pretrained(gcs.download(uri, tmp_path / name), dtype=torch.float32).eval()
    merged, base = load(merged_uri, "merged"), load(base_uri, "base")
    # The checkpoint is the adapter's fp32 master and its two AdamW moments, each item with
    # its framing in both ranks' files (about 2 KiB, most of the bytes at this tiny size),
    # never a copy of the base, whose fp32 weights alone would be larger than the bound.
    tensors = load_file(adapter / "adapter_model.safetensors")
    adapter_fp32 = 4 * sum(t.numel() for t in tensors.values())
    bound = 3 * adapter_fp32 + 2048 * 4 * len(tensors) * 2
    base_fp32 = 4 * sum(p.numel() for p in base.parameters())
    assert 3 * adapter_fp32 <= shard_bytes <= bound < base_fp32, (shard_bytes, adapter_fp32, bound, base_fp32)
    # The adapter trained: LoRA's B matrices start at zero, and only training moves them.
    assert any(t.abs().max() > 0 for name, t in tensors.items() if "lora_B" in name), sorted(tensors)
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        want, got = with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits
    # The merged export is written in the base's dtype (bf16): equal within its rounding.
    assert torch.allclose(got, want, atol=0.05 * want.abs().max().item()), (got - want).abs().max()


def preference_rows(rows: list[dict], count: int) -> list[dict]:
    """`count` preference pairs from the ground's dolly rows: a row's instruction as the
    prompt, its response chosen, the next row's response rejected (rows without context, so
    two sequences of a pair fit a block of the run's 128 tokens, the longer cut)."""
    pairs = []
    for row, following in zip(rows, rows[1:]):
        if not row["context"] and following["response"].strip() != row["response"].strip():
            pairs.append({"prompt": row["instruction"], "chosen": row["response"], "rejected": following["response"]})
    assert len(pairs) >= count, (len(pairs), count)
    return pairs[:count]


def _check_dpo_history(history: list[dict]) -> None:
    """Each epoch's DPO figures, on the training and the held-out pairs; the adapters moved
    the policy off its reference (the base with them off: every reward is 0 before a step)."""
    for entry in history:
        figures = entry.get("dpo") or {}
        assert {"rewardsChosen", "rewardsRejected", "margin", "accuracy", "evalRewardsChosen", "evalRewardsRejected",
                "evalMargin", "evalAccuracy"} <= set(figures), entry
        assert 0 <= figures["accuracy"] <= 1 and 0 <= figures["evalAccuracy"] <= 1, entry
        assert abs(figures["margin"] - (figures["rewardsChosen"] - figures["rewardsRejected"])) < 1e-3, entry
    assert any(entry["dpo"]["evalMargin"] != 0 for entry in history), history
    for entry in history:
        print(f"DPO epoch {entry['epoch']}: loss {entry.get('loss')} eval loss {entry.get('evalLoss')} {entry['dpo']}")


def _check_dpo_series(operator, namespace: str, name: str, last: dict) -> None:
    """The run's own series on the operator's /metrics hold its last epoch's DPO figures
    (the watch brings the final status a moment after the test read it)."""
    labels = (("name", name), ("namespace", namespace))
    wanted = {f"tpufinetune_run_{pairs}{figure}": last[key if not pairs else "eval" + key[0].upper() + key[1:]]
              for pairs in ("", "eval_")
              for figure, key in (("rewards_chosen", "rewardsChosen"), ("rewards_rejected", "rewardsRejected"),
                                  ("reward_margin", "margin"), ("preference_accuracy", "accuracy"))}

    def served():
        samples = scrape(operator)
        return {metric: samples.get((metric, labels)) for metric in wanted}
    seen = wait_for(lambda: (now := served()) == pytest.approx(wanted) and now, 30,
                    "the run's DPO series on /metrics", details=lambda: f"{served()} != {wanted}")
    print(f"DPO series of {namespace}/{name}: {seen}")


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_node_fails_over_and_the_run_resumes_from_its_checkpoint(
        operator, ground, kube, ground_assets, storage, tmp_path):
    # maxFailures: Ray Train restarts its worker group from the latest checkpoint inside the
    # job once KubeRay has replaced the lost worker.
    # The run is DPO with LoRA: its adapter-only checkpoint is what the restarted workers
    # resume from, and both exports (the PEFT adapter and the merged model) must load back.
    rows = [json.loads(line) for line in ground.gcs.read(ground_assets.data).decode().splitlines()]
    local = tmp_path / "pairs.jsonl"
    local.write_text("".join(json.dumps(pair) + "\n" for pair in preference_rows(rows, 256)))
    pairs = ground.gcs.upload(local, ground.gcs.unique_uri("data", "pairs") + "/pairs.jsonl")
    manifest = resource("node-killed", ground_assets, storage, epochs=3, dataset={"id": pairs},
                        training={"maxFailures": 1, "method": "dpo", "lora": {"rank": 8}})
    uid, cluster = start_run(kube, manifest)
    kube.wait_for(lambda: kube.status("node-killed").get("checkpointURI"), "a first checkpoint", timeout=400)
    pods = pods_by_uid(kube, cluster)
    head_node = next(p["spec"]["nodeName"] for p in pods.values() if p["metadata"]["labels"]["ray.io/node-type"] == "head")
    victims = [p["spec"]["nodeName"] for p in pods.values()
               if p["metadata"]["labels"]["ray.io/node-type"] == "worker" and p["spec"]["nodeName"] != head_node]
    assert victims, f"the scheduler put every worker beside the head on {head_node}: {pods}"
    victim = victims[0]
    lost = {u for u, p in pods.items() if p["spec"]["nodeName"] == victim}
    try:
        ground.kill_node(victim)
        # The real node-lifecycle controller: no heartbeat -> Unknown, unreachable taints.
        node = kube.wait_for(lambda: (n := node_of(ground, victim)) and ready_of(n)["status"] == "Unknown" and any(
            t["key"] == "node.kubernetes.io/unreachable" and t["effect"] == "NoExecute"
            for t in n["spec"].get("taints") or []) and n, f"{victim} NotReady and tainted", timeout=90)
        assert ready_of(node)["reason"] == "NodeStatusUnknown"
        # The taint-eviction controller deletes its pods once their tolerations run out; no
        # kubelet confirms, so they stay Terminating.
        kube.wait_for(lambda: all((p := pods_by_uid(kube, cluster).get(u)) is None or p["metadata"].get("deletionTimestamp")
                                  for u in lost), "the lost pods evicted", timeout=90)
        ground.delete_node(victim)  # what GKE does for a VM that is gone
        kube.wait_for(lambda: not lost & set(pods_by_uid(kube, cluster)), "the lost pods garbage-collected", timeout=150)

        def replaced():
            now = pods_by_uid(kube, cluster)
            return len(now) == len(pods) and all(p["status"].get("phase") == "Running" for p in now.values()) and now
        again = kube.wait_for(replaced, "KubeRay's replacements Running", timeout=300, interval=2)
        assert not lost & set(again) and victim not in {p["spec"]["nodeName"] for p in again.values()}

        def resumed():  # read while the run lasts: its RayCluster goes when it ends
            try:
                return "Resumed from " in kube.head_job_client(cluster).get_job_logs(f"tft-{uid}-1")
            except Exception:  # the head between answers, or already released
                return kube.status("node-killed").get("phase") not in ("Running", None) and "run ended first"
        assert kube.wait_for(resumed, "Ray Train's restart from the checkpoint", timeout=300, interval=2) is True

        status = kube.wait_for(lambda: (s := kube.status("node-killed")).get("phase") in ("Succeeded", "Failed") and s,
                               "the run to end", timeout=600, interval=2)
        assert status["phase"] == "Succeeded", status.get("message")
        assert status["attempt"] == 1 and [e["epoch"] for e in status["history"]] == [1, 2, 3]
        _check_dpo_history(status["history"])
        _check_dpo_series(operator, kube.ns, "node-killed", status["history"][-1]["dpo"])
        _check_lora_exports(ground.gcs, ground_assets.model, storage, status, tmp_path)
    finally:
        ground.restore_node(victim)


# The Spot run's epochs also answer a few held-out prompts, briefly (generation metrics).
SPOT_GENERATE = {"examples": 2, "maxNewTokens": 4}


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of an attempt's event files, as TensorBoard reads them: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _check_tensorboard(gcs, storage: str, status: dict, tmp_path: Path) -> None:
    """The run's event files in the bucket, one folder per attempt: every epoch's loss once at
    its step, and the per-step loss from step 1 to the last with no gap and no repeat, attempt
    1's up to the step the checkpoint attempt 2 resumed from held, attempt 2's from the next."""
    uri = status.get("tensorboardURI")
    run_folder = status["attempts"][0]["logsURI"].rsplit("/logs/", 1)[0]  # <storage>/<the trainer's run name>
    assert run_folder.startswith(f"{storage}/") and uri == f"{run_folder}/tensorboard", (uri, run_folder)
    names = gcs.list(uri)
    assert {name.split("/", 1)[0] for name in names} == {"attempt-1", "attempt-2"}, names
    one, two = (tensorboard_scalars(gcs.download(f"{uri}/{attempt}", tmp_path / "tensorboard" / attempt))
                for attempt in ("attempt-1", "attempt-2"))
    preempted, resumed, history = status["attempts"][0], status["attempts"][-1]["resumedStep"], status["history"]
    first_steps, second_steps = ([step for step, _ in s.get("train/loss", [])] for s in (one, two))
    print(json.dumps({"resumedStep": resumed, "attempt-1": first_steps, "attempt-2": second_steps,
                      "history": [(e["epoch"], e["step"]) for e in history]}))
    # The loss at each progress event (every 30 s and at each epoch's end on the ground:
    # the operator leaves the trainer's --progress-interval alone; a notice's step has one
    # only when it falls on one of them) on one step axis: attempt 1's up to the step the
    # checkpoint attempt 2 resumed from holds (at most the step in flight after it), attempt
    # 2's after it, to the run's last step; none twice.
    assert first_steps and first_steps == sorted(set(first_steps)), first_steps
    assert first_steps[-1] <= resumed + 1, (resumed, first_steps)
    assert second_steps and second_steps == sorted(set(second_steps)), (resumed, second_steps)
    assert second_steps[0] > resumed and second_steps[-1] == history[-1]["step"], (resumed, second_steps)
    run_steps = [step for step in first_steps if step <= resumed] + second_steps
    assert run_steps == sorted(set(run_steps)), run_steps
    # Each epoch's loss once, at its step, in the attempt that ended it; the same for its
    # generation metrics.
    epoch_losses = ([(step, v) for step, v in one.get("epoch/loss", []) if step <= resumed]
                    + two.get("epoch/loss", []))
    assert [step for step, _ in epoch_losses] == [e["step"] for e in history], (epoch_losses, history)
    assert [v for _, v in epoch_losses] == pytest.approx([e["loss"] for e in history], abs=1e-4)  # status: 4 decimals
    exact = [(step, v) for step, v in one.get("eval/exact_match", []) if step <= resumed] + two["eval/exact_match"]
    assert exact == [(e["step"], pytest.approx(e["eval"]["exactMatch"], abs=1e-4)) for e in history], exact


def _from_submission(entry: dict) -> float:
    """An attempt's seconds from its job's submission to its first step (status.attempts[].startup)."""
    startup = entry["startup"]
    return round(startup["firstStepSeconds"] - startup["jobSubmittedSeconds"], 1)


def _check_warm_retry(status: dict) -> None:
    """What each attempt's start did, as its status says (status.attempts[].startup.trainer):
    the first tokenized the data and compiled every graph; the retry found the first's
    tokenized data and compiled graphs in the run's storage. Both attempts' seconds
    from submission to first step are printed (not bounded: on this machine the workers' and
    the model's start, which a retry repeats, take most of them)."""
    first, retry = status["attempts"][0], status["attempts"][-1]
    figures = {entry["attempt"]: {"fromSubmission": _from_submission(entry), **entry["startup"]}
               for entry in (first, retry)}
    ratio = figures[retry["attempt"]]["fromSubmission"] / max(figures[first["attempt"]]["fromSubmission"], 1e-9)
    print(f"time to first step from submission: {json.dumps(figures)}; retry/first {ratio:.2f}")
    cold, warm = first["startup"]["trainer"], retry["startup"]["trainer"]
    assert cold["dataSource"] == "Tokenized" and cold["tokenizedExamples"] > 0, first["startup"]
    assert cold["compileCacheHits"] == 0 and cold["compileCacheMisses"] > 0, first["startup"]
    assert warm["compileCacheHits"] > 0, retry["startup"]
    # The retry's new head pod found the data attempt 1 published, not tokenized again.
    assert warm["dataSource"] == "RunStorage" and warm["tokenizedExamples"] == 0, retry["startup"]
    # A retry resumed from a step checkpoint at an epoch's last step did that epoch's end before
    # its first step, and says how long it took; one resumed inside an epoch, or from the
    # epoch's own checkpoint (its end done), has none to say.
    epoch_ends = {entry["step"] for entry in status["history"]}
    end_left = (retry.get("resumedStep") in epoch_ends
                and retry.get("resumedFrom", "").rstrip("/").rsplit("/", 1)[-1].startswith("step_"))
    assert ("resumedEpochEndSeconds" in warm) == end_left, (retry, epoch_ends)


@pytest.mark.ray
@pytest.mark.slow
def test_a_spot_worker_gets_maintenance_notice_pdb_protection_and_a_graceful_preemption(
        operator, ground, kube, ground_assets, storage, tmp_path):
    pool = cpu_pool("cpu-spot", nodes=1, spot=True)
    spot_node = pool.node_names()[0]
    ground.add_pools([pool])
    try:
        toleration = {"key": SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        (tmp_path / "lmeval-task").mkdir()
        include = upload_task(ground.gcs, tmp_path / "lmeval-task")
        # Far more epochs than the first attempt can train before its node is preempted; the
        # retry gets fewer (below). Each epoch's end answers a few prompts, and the export is
        # evaluated with lm-eval before the run succeeds.
        # Compile on: the retry's start finds the first attempt's compiled graphs in the run's
        # storage.
        manifest = resource("spot", ground_assets, storage, epochs=50, maxRetries=1,
                            tpu={"topology": "1", "spot": True}, workers={"tolerations": [toleration]},
                            training={"evaluation": {"generate": SPOT_GENERATE}, "compile": "on"},
                            evaluation=lm_eval_spec(include))
        _, cluster = start_run(kube, manifest)
        running(kube, "spot")
        # The trainer steps: a notice then has a step to save (before, the job would only
        # wait for its worker to come back).
        kube.wait_for(lambda: (kube.status("spot").get("progress") or {}).get("step", 0) >= 1,
                      "the trainer's first steps", timeout=300, interval=1)
        # And an epoch's figures (the retry's target is set below them): with compile on, the
        # first progress event can come before the first epoch's end.
        kube.wait_for(lambda: kube.status("spot").get("history"), "the first epoch's figures", timeout=300,
                      interval=1)
        worker = next(p for p in kube.pods_of(cluster) if p["metadata"]["labels"]["ray.io/node-type"] == "worker")
        assert worker["spec"]["nodeName"] == spot_node

        start = int(time.time()) + 3600
        ground.set_maintenance(spot_node, start)
        # What the operator made of GKE's label, not the label the test just wrote: it asked
        # the trainer for a checkpoint now, once, and says so in status.
        maintenance = kube.wait_for(lambda: kube.status("spot").get("maintenance"), "the operator's maintenance notice",
                                    timeout=60)
        assert maintenance["nodes"] == [spot_node] and maintenance["requests"] == 1, maintenance

        # A budget the user keeps on the workers (the product makes none for them): the drain
        # honours it and only cordons, so what ends the attempt below is the preemption alone.
        kube.apply({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "spot-worker"},
                    "spec": {"minAvailable": 1, "selector": {"matchLabels": {
                        "ray.io/cluster": cluster, "ray.io/node-type": "worker"}}}})
        kube.wait_for(lambda: (kube.get("pdb", "spot-worker").get("status") or {}).get("expectedPods") == 1,
                      "the disruption controller to count the worker")
        drain = ground.drain_node(spot_node, timeout=10)
        same = kube.get("pod", worker["metadata"]["name"])
        if same is None or same["metadata"]["uid"] != worker["metadata"]["uid"] or same["metadata"].get("deletionTimestamp"):
            pytest.fail(f"the test's premise: the drain evicted the worker despite the budget ({drain})", pytrace=False)
        # The maintenance is called off before the preemption comes (GKE drops the label),
        # so that what ends the attempt is the preemption alone.
        ground.kubectl("label", "node", spot_node, f"{MAINTENANCE_LABEL}-")
        status = kube.status("spot")
        assert status["phase"] == "Running" and status["attempt"] == 1, status.get("message")

        # KubeRay deletes a Failed worker at once: the watch sees the status it had.
        uid = worker["metadata"]["uid"]

        def shutdown_exit_code(pods: list[dict]) -> int:
            return max((s["state"]["terminated"]["exitCode"] for p in pods if p["metadata"]["uid"] == uid
                        and p["status"].get("reason") == "Terminated" and p["status"].get("message") == SHUTDOWN_MESSAGE
                        for s in p["status"].get("containerStatuses") or [] if "terminated" in s["state"]), default=0)

        with KubeWatch(ground.cp.kubeconfig, kube.ns, shutdown=shutdown_exit_code) as pods:
            ground.preempt_node(spot_node)
            kube.wait_for(lambda: pods.most["shutdown"], "the worker shut down with its node", timeout=60)
        # The preStop hook first (the trainer saved its step), then SIGTERM, which Ray's own
        # handler answered: it stopped the pod's Ray processes and exited 1 within the pod's
        # share of the notice (no Serve drain: sizing.SHUTDOWN_ENV). A SIGKILL at the end of
        # that share would read 137.
        log = pod_log_path(ground.workdir, kube.ns, worker["metadata"]["name"]).read_text()
        assert ": preStop " in log, log[-2000:]
        assert pods.most["shutdown"] == 1, pods.most
        kube.wait_for(lambda: node_of(ground, spot_node) is None, "the preempted node gone", timeout=90)

        # The first attempt has ended; the retry waits for a Spot node. A spec edit applies
        # to the next attempt: a target eval loss ends the run at an epoch end of the retry's
        # (below). (An edit of the epochs would change what the checkpoint was
        # trained for, and the resume would be refused: docs/api.md.)
        status = kube.wait_for(lambda: (s := kube.status("spot")).get("attempt", 1) >= 2 and s, "the retry",
                               timeout=120)
        epochs_before = len(status.get("history") or [])
        # A target below every eval loss so far (the notice's checkpoint may be an epoch's end
        # whose figures are not in status yet): the retry trains on from the resumed step
        # before it stops (the first epochs' eval loss falls by about 0.15 an epoch).
        target = min(e["evalLoss"] for e in status["history"]) - 0.3
        kube.kubectl("patch", "tpufinetune", "spot", "--type=merge",
                     "-p", json.dumps({"spec": {"training": {"targetEvalLoss": target}}}))
        # The Spot pool refills: a fresh VM under the same name, where the retry runs.
        ground.restore_node(spot_node)
        status = kube.wait_for(lambda: (s := kube.status("spot")).get("phase") in ("Succeeded", "Failed") and s,
                               "the run to end", timeout=600, interval=2)
        assert status["phase"] == "Succeeded", status.get("message")
        # Each epoch's generation metrics, lm-eval's on the export (on the retry's cluster),
        # and the TensorBoard curves across the two attempts.
        for epoch in status["history"]:
            generation = epoch.get("eval") or {}
            assert 1 <= generation.get("examples", 0) <= SPOT_GENERATE["examples"], epoch
            assert {"exactMatch", "rougeL", "bleu"} <= generation.keys(), epoch
            assert generation.get("samplesURI", "").endswith(f"/eval-samples/epoch-{epoch['epoch']}.jsonl"), epoch
        check_evaluated(status, ground.gcs)
        _check_tensorboard(ground.gcs, storage, status, tmp_path)
        preempted = [a for a in status["attempts"] if a.get("reason") == "Preempted"]
        assert len(preempted) == 1 and preempted[0]["attempt"] == 1, [
            (a["attempt"], a.get("reason"), a.get("message"), a.get("lastStep")) for a in status["attempts"]]
        # The worker's preStop hook had the trainer save the step it was on: at most the step
        # in flight when SIGTERM came is lost (attempts.py: lastStep - checkpointStep).
        assert preempted[0]["lostSteps"] <= 1, preempted[0]
        # That bound alone holds without any save: the steps after the last checkpoint that
        # the trainer never reported count as none lost. So the save itself: the checkpoint
        # written on SIGTERM, of the attempt's last step, is the one the retry resumed from
        # (a step checkpoint; or the epoch's own, written at once, when the signal came
        # during the epoch's end).
        saved = [e["message"] for e in kube.items("events", "--field-selector", "involvedObject.name=spot")
                 if e["reason"] == "CheckpointOnNotice" and e["message"].startswith("SIGTERM")]
        resumed = status["attempts"][-1]["resumedFrom"]
        found = [m for m in saved if m.endswith(f" written to {resumed}")]
        assert len(found) == 1, (resumed, preempted[0], saved, shipped_lines(ground, preempted[0]))
        step = int(found[0].split("checkpoint of step ", 1)[1].split(" ", 1)[0])
        assert 0 <= preempted[0]["lastStep"] - step <= 1, (resumed, preempted[0])
        assert status["attempts"][-1]["resumedStep"] == step, status["attempts"][-1]
        assert status["attempts"][-1]["reason"] == "Succeeded", status["attempts"]
        assert status["attempts"][-1]["resumedFrom"], status["attempts"]
        stop = status["earlyStop"]
        assert stop["reason"] == "TargetEvalLoss", stop
        # The export is the checkpoint that reached the target, not the last one written.
        assert status["checkpointURI"] == stop["checkpointURI"], (status["checkpointURI"], stop)
        assert status["timeToTarget"] > 0
        assert status["exportedModelURI"] and ground.gcs.list(status["exportedModelURI"])
        # Every epoch once, and the retry trained to an epoch end of its own.
        history = [e["epoch"] for e in status["history"]]
        assert history == list(range(1, len(history) + 1)) and len(history) > epochs_before, history
        _check_warm_retry(status)
    finally:
        kube.kubectl("delete", "tpufinetune", "spot", "--wait=false", check=False)
        ground.remove_pool(pool)


def shipped_lines(ground, attempt: dict, words=("notice", "SIGTERM", "checkpoint", "epoch", "Preempted")) -> str:
    """What a failed check shows: the attempt's logs as the trainer shipped them to the bucket
    (driver and workers, status.attempts[].logsURI), the lines about the notice and saves."""
    uri = attempt.get("logsURI")
    if not uri:
        return "(no logsURI)"
    lines = []
    for name in ground.gcs.list(uri):
        for line in ground.gcs.read(f"{uri}/{name}").decode(errors="replace").splitlines():
            if any(word in line for word in words):
                lines.append(f"{name.split('/')[0]}: {line[:300]}")
    shown = "\n".join(lines[-60:])
    print(f"attempt {attempt.get('attempt')}'s shipped logs ({uri}), the lines about notices and saves:\n{shown}")
    return shown

