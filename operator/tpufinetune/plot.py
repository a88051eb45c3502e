"""A run's loss curves as a picture: `status.curve` (training loss, learning rate) and
`status.history` (eval loss per epoch) against the optimizer step. `figure` is pure (a
status dict in, a matplotlib Figure out) and needs only matplotlib, the `plot` extra;
`tpufinetune plot` reads the status and saves it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

EXTRA_HINT = "pip install 'tpufinetune[plot]'"
# Fixed colours, so a picture (and a test reading its pixels) does not depend on a style.
TRAIN_COLOR = "#1f77b4"
EVAL_COLOR = "#d62728"
LR_COLOR = "#9a9a9a"
BACKGROUND = "#ffffff"
DPI = 100
SIZE = (8.0, 4.5)  # inches


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def figure_class():
    """matplotlib's Figure, drawn by Agg (files only, never a window, and no pyplot
    registry holding every figure made); PlotUnavailable names the extra."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"tpufinetune plot needs matplotlib: {EXTRA_HINT}") from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    return Figure


def curve_points(status: dict, field: str) -> list[tuple[int, float]]:
    """(step, value) of each status.curve point that has `field`."""
    return [(p["step"], p[field]) for p in status.get("curve") or []
            if p.get("step") is not None and p.get(field) is not None]


def training_points(status: dict) -> list[tuple[int, float]]:
    return curve_points(status, "loss")


def eval_points(status: dict) -> list[tuple[int, float]]:
    """(step, evalLoss) of each evaluated epoch whose step is known, by step."""
    return sorted((e["step"], e["evalLoss"]) for e in status.get("history") or []
                  if e.get("step") is not None and e.get("evalLoss") is not None)


def learning_rate_points(status: dict) -> list[tuple[int, float]]:
    return curve_points(status, "learningRate")


def figure(status: dict, title: str = "") -> "Figure":
    """The loss curves of `status` (a TPUFineTune's status, as the API server returns it).
    Training loss and eval loss share the left axis; the learning rate, when reported, is
    a dashed line on the right axis, drawn under the losses."""
    # The legend goes under the axes, never over a point.
    fig = figure_class()(figsize=SIZE, dpi=DPI, facecolor=BACKGROUND, layout="constrained")
    ax = fig.subplots()
    ax.set_facecolor(BACKGROUND)
    train, evals, rates = training_points(status), eval_points(status), learning_rate_points(status)
    handles = []
    if rates:
        lr_ax = ax.twinx()
        handles += lr_ax.plot(*zip(*rates), color=LR_COLOR, linestyle="--", linewidth=1, label="learning rate",
                              gid="learning-rate")
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.set_zorder(lr_ax.get_zorder() + 1)  # the losses over the learning rate
        ax.patch.set_visible(False)
    if train:
        handles += ax.plot(*zip(*train), color=TRAIN_COLOR, linewidth=1.5, marker="o", markersize=3,
                           label="training loss (progress window)", gid="training-loss")
    if evals:
        handles += ax.plot(*zip(*evals), color=EVAL_COLOR, linewidth=1.5, marker="s", markersize=6,
                           label="eval loss (epoch end)", gid="eval-loss")
    if not train and not evals:
        ax.text(0.5, 0.5, "no loss reported yet", transform=ax.transAxes, ha="center", va="center")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    phase = status.get("phase")
    ax.set_title(" ".join(part for part in (title, f"({phase})" if phase else "") if part))
    return fig


def save(fig: "Figure", path) -> None:
    """Write `fig` as a PNG at the figure's own dpi (pixels match `fig.dpi` transforms),
    without a version stamp, so the same status gives the same file."""
    fig.savefig(path, format="png", dpi=fig.dpi, facecolor=fig.get_facecolor(), metadata={"Software": None})
