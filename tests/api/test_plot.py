"""`tpufinetune plot` (tpufinetune/plot.py): the figure of a status, checked in its line
data and in the pixels of the PNG written, and the command against a real API server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tpufinetune import cli
from tpufinetune.core.runevents import apply_event
from tpufinetune.plot import (BACKGROUND, DPI, EVAL_COLOR, SIZE, TRAIN_COLOR, eval_points, figure,
                              save, training_points)

REPO = Path(__file__).resolve().parents[2]


def events() -> list[dict]:
    """A run as the trainer reports it: 2 epochs of 50 steps, a progress sample every 5,
    an evaluation at each epoch's end (above the training loss, so the lines stay apart)."""
    out = [{"event": "plan", "v": 1, "total_steps": 100}]
    for step in range(5, 101, 5):
        out.append({"event": "progress", "v": 1, "epoch": 1 + (step - 1) // 50, "epochs": 2, "step": step,
                    "total_steps": 100, "loss": round(3.0 - step / 50, 4), "lr": 1e-4 * (1 - step / 125),
                    "tokens_per_s": 900.0, "step_time_s": 0.1, "training_s": step * 0.1})
        if step % 50 == 0:
            out.append({"event": "epoch", "v": 1, "epoch": step // 50, "epochs": 2, "step": step,
                        "total_steps": 100, "loss": 2.0, "eval_loss": 4.5 - step / 100})
    return out


def status() -> dict:
    folded: dict = {"phase": "Running"}
    for event in events():
        apply_event(folded, event)
    return folded


def lines(fig) -> dict:
    return {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}


def rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def test_the_lines_are_the_status_points():
    s = status()
    drawn = lines(figure(s, "ns/demo"))
    assert set(drawn) == {"training-loss", "eval-loss", "learning-rate"}
    assert list(zip(drawn["training-loss"].get_xdata(), drawn["training-loss"].get_ydata())) == \
        [(p["step"], p["loss"]) for p in s["curve"]]
    assert list(zip(drawn["eval-loss"].get_xdata(), drawn["eval-loss"].get_ydata())) == \
        [(50, 4.0), (100, 3.5)] == [(e["step"], e["evalLoss"]) for e in s["history"]]
    assert list(drawn["learning-rate"].get_ydata()) == [p["learningRate"] for p in s["curve"]]
    assert len(training_points(s)) == 20 and eval_points(s) == [(50, 4.0), (100, 3.5)]


def test_the_png_shows_each_point_where_the_axes_put_it(tmp_path):
    """Each point's pixel, found through the axes' data-to-pixel transform at the saved
    dpi, has its line's colour; a place with no line is background. A point shifted or
    left out fails here."""
    from matplotlib.image import imread

    fig = figure(status(), "ns/demo")
    path = tmp_path / "demo.png"
    save(fig, path)
    image = imread(path)
    height, width = image.shape[:2]
    assert (width, height) == (SIZE[0] * DPI, SIZE[1] * DPI)
    ax = next(ax for ax in fig.axes if lines_of(ax, "training-loss"))

    def pixel(x: float, y: float) -> tuple[float, float, float]:
        px, py = ax.transData.transform((x, y))
        return tuple(float(c) for c in image[int(height - py), int(px), :3])

    def near(found, expected) -> bool:
        return max(abs(a - b) for a, b in zip(found, expected)) < 0.03

    s = status()
    for step, loss in training_points(s):
        assert near(pixel(step, loss), rgb(TRAIN_COLOR)), (step, loss, pixel(step, loss))
    for step, loss in eval_points(s):
        assert near(pixel(step, loss), rgb(EVAL_COLOR)), (step, loss, pixel(step, loss))
    # Between the eval line (4.0 at step 50) and the training line (2.0 there), off the
    # grid and above the learning rate's line: background. So is the place of a point
    # moved up by 0.4: a shifted curve fails the checks above and this one.
    assert near(pixel(57, 3.2), rgb(BACKGROUND)), pixel(57, 3.2)
    assert near(pixel(15, 3.1), rgb(BACKGROUND)) and 3.1 - 0.4 == pytest.approx(3.0 - 15 / 50)


def lines_of(ax, gid: str) -> list:
    return [line for line in ax.get_lines() if line.get_gid() == gid]


def test_a_status_with_nothing_to_draw_says_so():
    fig = figure({"phase": "Pending"}, "ns/new")
    assert not lines(fig)
    assert [t.get_text() for t in fig.axes[0].texts] == ["no loss reported yet"]


def test_the_same_status_gives_the_same_file(tmp_path):
    save(figure(status(), "ns/demo"), tmp_path / "a.png")
    save(figure(status(), "ns/demo"), tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_without_matplotlib_the_command_names_the_extra():
    # Python refuses an import whose sys.modules entry is None: matplotlib absent, as in
    # an environment without the plot extra (the one fault this test has to make up).
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tpufinetune import cli; sys.exit(cli.main(['plot', 'demo']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO / "operator"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == cli.EXIT_INVALID
    assert "pip install 'tpufinetune[plot]'" in proc.stderr


def test_the_plot_extra_pins_kubernetes_as_the_operator_does():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {extra: dict(p.split("==") for p in extras[extra]) for extra in ("plot", "operator", "test")}
    assert pins["plot"]["kubernetes"] == pins["operator"]["kubernetes"]
    assert pins["plot"]["matplotlib"] == pins["test"]["matplotlib"]


def test_plot_reads_the_run_from_the_api_server_and_writes_its_png(control_plane, namespace, tmp_path, capsys):
    manifest = {"apiVersion": "tpufinetune.dev/v1alpha1", "kind": "TPUFineTune",
                "metadata": {"name": "demo", "namespace": namespace},
                "spec": {"tpu": {"generation": "v6e", "topology": "2x2"}, "image": "registry.example/t:1",
                         "checkpoint": {"storagePath": "gs://b/ckpt"}}}
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    control_plane.kubectl("-n", namespace, "patch", "tpufinetune", "demo", "--subresource=status", "--type=merge",
                          "-p", json.dumps({"status": status()}))
    out = tmp_path / "demo.png"
    assert cli.main(["plot", "demo", "-n", namespace, "-o", str(out),
                     "--kubeconfig", str(control_plane.kubeconfig)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    expected = tmp_path / "expected.png"
    save(figure(status(), f"{namespace}/demo"), expected)
    # What the API server kept (every status key declared) drawn exactly as the status.
    assert out.read_bytes() == expected.read_bytes()
    assert cli.main(["plot", "missing", "-n", namespace, "-o", str(tmp_path / "m.png"),
                     "--kubeconfig", str(control_plane.kubeconfig)]) == 1
    assert f"tpufinetune {namespace}/missing not found" in capsys.readouterr().err
