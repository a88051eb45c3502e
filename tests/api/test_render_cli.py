"""`tpufinetune render FILE`: YAML out on success; exit 2 and one stderr line naming the
field otherwise."""
from __future__ import annotations

import io
import shlex

import pytest
import yaml
from api_spec_cases import INVALID, base_spec, spec_with

import tpufinetune
from tpufinetune import cli
from tpufinetune.core import render as render_module
from tpufinetune.core.render import PLACEHOLDER_UID

UID = "6f1c2a7e-0b1d-4c55-9a57-3c1e0d2b8f10"


def resource(name: str, spec: dict, **metadata: str) -> dict:
    return {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
            "metadata": {"name": name, **metadata}, "spec": spec}


def run(tmp_path, capsys, *documents: object, text: str | None = None, flags=()):
    path = tmp_path / "run.yaml"
    path.write_text(text if text is not None else yaml.safe_dump_all(documents))
    code = cli.main(["render", *flags, str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def _commented_job(out: str, index: int) -> dict:
    """The job shown as a comment after the index-th RayCluster."""
    block = out.split("---\n")[index + 1]
    lines = block.split("the Ray job the operator submits", 1)[1].splitlines()[1:]
    return yaml.safe_load("\n".join(line.removeprefix("#   ") for line in lines
                                     if line.startswith("#   ")))["rayJobSubmission"]


def test_stdout_holds_only_the_rayclusters_with_each_job_as_a_comment(tmp_path, capsys):
    code, out, err = run(tmp_path, capsys,
                         resource("a", base_spec(), namespace="ml", uid=UID),
                         resource("b", spec_with(mode="collectives", checkpoint=None,
                                                 tpu={"generation": "v7x", "topology": "2x2x2"})))
    assert (code, err) == (0, "")
    docs = list(yaml.safe_load_all(out))
    assert [(d["apiVersion"], d["kind"]) for d in docs] == [("ray.io/v1", "RayCluster")] * 2
    cluster = docs[0]
    assert cluster["metadata"]["name"] == "tft-a" and cluster["metadata"]["namespace"] == "ml"
    assert cluster["metadata"]["ownerReferences"][0]["uid"] == UID
    job = _commented_job(out, 0)
    assert job["submissionId"] == f"tft-{UID}-1"
    assert shlex.split(job["entrypoint"]) == job["entrypointArgv"]
    assert job["entrypointArgv"][:2] == ["tpufinetune-train", "finetune"]
    assert _commented_job(out, 1)["entrypointArgv"][:2] == ["tpufinetune-train",
                                                            "collectives"]
    assert docs[1]["metadata"]["namespace"] == "default"


def test_jobs_flag_prints_the_job_submissions_as_yaml(tmp_path, capsys):
    code, out, _ = run(tmp_path, capsys, resource("a", base_spec(), uid=UID),
                       flags=["--jobs"])
    assert code == 0
    (doc,) = list(yaml.safe_load_all(out))
    assert doc["rayJobSubmission"]["submissionId"] == f"tft-{UID}-1"


def test_absent_uid_renders_an_unowned_raycluster_and_says_so(tmp_path, capsys):
    code, out, _ = run(tmp_path, capsys, resource("a", base_spec()))
    assert code == 0
    assert "# metadata.uid is absent: no ownerReferences" in out
    (cluster,) = list(yaml.safe_load_all(out))
    # An owner that does not exist would have the garbage collector delete it at once.
    assert "ownerReferences" not in cluster["metadata"]
    assert _commented_job(out, 0)["submissionId"] == f"tft-{PLACEHOLDER_UID}-1"


def test_pod_settings_reach_the_rendered_raycluster(tmp_path, capsys):
    spec = spec_with(workers={"annotations": {"gke-gcsfuse/volumes": "true"}})
    code, out, _ = run(tmp_path, capsys, resource("a", spec))
    (cluster,) = list(yaml.safe_load_all(out))
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]
    assert worker["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_spec_exits_2_with_one_line_naming_the_field(tmp_path, capsys, case):
    code, out, err = run(tmp_path, capsys, resource("bad", case.spec))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f'TPUFineTune "bad": {case.field}: ' in err
    assert case.message in err


def test_nothing_is_printed_when_a_later_document_is_invalid(tmp_path, capsys):
    code, out, err = run(tmp_path, capsys, resource("good", base_spec()),
                         resource("bad", spec_with(tpu__topology="3x3")))
    assert code == 2 and out == "" and "spec.tpu.topology" in err


@pytest.mark.parametrize("text,expected", [
    ("kind: Deployment\napiVersion: apps/v1\nmetadata: {name: x}\n", "expected apiVersion"),
    ("apiVersion: tpufinetune.dev/v1alpha1\nkind: TPUFineTune\nmetadata: {name: Bad_Name}\n",
     "metadata.name"),
    ("a: [unclosed\n", "not valid YAML"),
    ("", "no YAML documents"),
    ("- just\n- a list\n", "not a mapping"),
])
def test_input_that_is_not_a_tpufinetune_is_refused_in_one_line(tmp_path, capsys, text,
                                                                 expected):
    code, out, err = run(tmp_path, capsys, text=text)
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err


def test_missing_file_is_one_line(tmp_path, capsys):
    assert cli.main(["render", str(tmp_path / "absent.yaml")]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "absent.yaml" in err


def test_reads_stdin_with_dash(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(resource("s", base_spec()))))
    assert cli.main(["render", "-"]) == 0
    assert "tft-s" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.strip() == f"tpufinetune {tpufinetune.__version__}"


def test_subcommands_come_from_one_table():
    assert "render" in [c.name for c in cli.SUBCOMMANDS]
    with pytest.raises(SystemExit) as caught:
        cli.main([])
    assert caught.value.code == 2


def test_a_run_that_cannot_fit_its_slice_is_refused_with_the_figure_and_what_fits(tmp_path, capsys):
    big = spec_with(model={"id": "google/gemma-4-31B-it"})
    code, out, err = run(tmp_path, capsys, resource("big", big))
    assert (code, out) == (2, "")
    assert err.startswith('tpufinetune render: ') and 'TPUFineTune "big": does not fit' in err
    assert "GiB of HBM per chip" in err and "28.8 GiB usable on v6e" in err and "smallest that fits" in err


def test_a_run_that_fits_shows_its_memory_plan_as_a_comment(tmp_path, capsys):
    code, out, err = run(tmp_path, capsys, resource("small", spec_with(model={"id": "google/gemma-4-E2B-it"})))
    assert (code, err) == (0, "")
    assert "# TPUFineTune default/small: memory plan: full fine-tune of google/gemma-4-E2B-it:" in out
    assert [d["kind"] for d in yaml.safe_load_all(out)] == ["RayCluster"]


INJECTED = "\ninjected: true #"  # the rest of the line, if any, a comment


@pytest.mark.parametrize("where, field", [("model", "spec.model.id"), ("dataset", "spec.dataset.id"),
                                          ("namespace", "metadata.namespace")])
@pytest.mark.parametrize("flags", [(), ("--jobs",)], ids=["clusters", "jobs"])
def test_a_line_break_in_a_user_string_never_becomes_a_line_of_yaml(tmp_path, capsys, where, field, flags):
    """`render x.yaml | kubectl apply -f -`: text after a line break in a spec's string must
    not become a key of what is applied (it is refused, and would be escaped)."""
    spec, metadata = spec_with(), {"namespace": "team"}
    if where == "namespace":
        metadata["namespace"] = "team" + INJECTED
    else:
        spec = spec_with(**{f"{where}__id": "org/own-one" + INJECTED})
    code, out, err = run(tmp_path, capsys, resource("run", spec, **metadata), flags=flags)
    documents = [d for d in yaml.safe_load_all(out) if d]
    assert not [d for d in documents if "injected" in d], out
    assert not [line for line in out.splitlines() if not line.startswith("#") and "injected" in line], out
    assert (code, out) == (2, "") and err.count("\n") == 1 and field in err, err


def test_a_comment_escapes_what_would_end_it():
    text = "plan of org/m\nkind: Secret\rb\x85c\u2028d\u2029e\x0bf\x1b[2J\tg"
    commented = render_module.comment(text)
    assert all(line.startswith("# ") for line in commented.splitlines())
    assert commented.count("\n") == len(commented.splitlines())
    assert yaml.safe_load(commented) is None and yaml.safe_load("a: 1\n" + commented + "b: 2\n") == {"a": 1, "b": 2}
    assert "\\x1b[2J\\tg" in commented  # what stays on a line is escaped, not dropped
