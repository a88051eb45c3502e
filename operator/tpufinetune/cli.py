"""The `tpufinetune` command. Each subcommand is one entry in SUBCOMMANDS: a name, a help
line, a function that adds its arguments and a function that runs it and returns the exit
status. Handlers import what they need, so a light subcommand never loads a heavy one's
dependencies.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import __version__

EXIT_INVALID = 2  # an input the command refuses (same status argparse uses for usage errors)


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _render_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="TPUFineTune YAML (one or more documents); - for stdin")
    parser.add_argument("--jobs", action="store_true",
                        help="print the Ray job submissions as YAML instead of the "
                             "RayClusters (which show them as comments)")


def _render(args: argparse.Namespace) -> int:
    from .core.render import RenderError, load_documents, render

    source = "<stdin>" if args.file == "-" else args.file
    try:
        try:
            text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        except OSError as exc:
            raise RenderError(f"{source}: {exc.strerror or exc}") from None
        output = render(load_documents(text, source), source, jobs=args.jobs)
    except RenderError as exc:
        print(f"tpufinetune render: {exc}", file=sys.stderr)
        return EXIT_INVALID
    sys.stdout.write(output)
    return 0


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    # Defined here, not in local.py: building the parser must not load the operator's stack.
    parser.add_argument("--local", action="store_true", required=True,
                        help="use a local Ray head instead of a RayCluster (the only mode)")
    parser.add_argument("file", help="TPUFineTune YAML file, or - for stdin")
    parser.add_argument("--address", help="Ray dashboard URL (default $RAY_DASHBOARD_ADDRESS "
                                          "or http://127.0.0.1:8265)")
    parser.add_argument("--uid", help="resource uid; reuse one to re-attach to its job")


def _run(args: argparse.Namespace) -> int:
    from .local import main as run_local

    return run_local(args)


def _operator_arguments(parser: argparse.ArgumentParser) -> None:
    from .serve import add_arguments

    add_arguments(parser)


def _operator(args: argparse.Namespace) -> int:
    from .serve import run

    return run(args)


def _plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the TPUFineTune's name")
    parser.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig "
                                                  "context's, else default)")
    parser.add_argument("-o", "--output", type=Path, help="PNG to write (default NAME.png)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default $KUBECONFIG or "
                                             "~/.kube/config)")


def _plot(args: argparse.Namespace) -> int:
    from .plot import EXTRA_HINT, PlotUnavailable, figure, figure_class, save

    try:
        figure_class()  # before reaching for the cluster
    except PlotUnavailable as exc:
        print(f"tpufinetune plot: {exc}", file=sys.stderr)
        return EXIT_INVALID
    try:
        from .adapters.readrun import read_tpufinetune
    except ImportError as exc:
        print(f"tpufinetune plot: {exc.name or exc} is not installed: {EXTRA_HINT}", file=sys.stderr)
        return EXIT_INVALID
    output = args.output or Path(f"{args.name}.png")
    try:
        namespace, obj = read_tpufinetune(args.name, args.namespace, args.kubeconfig)
        save(figure(obj.get("status") or {}, title=f"{namespace}/{args.name}"), output)
    except LookupError as exc:
        print(f"tpufinetune plot: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tpufinetune plot: {output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(output)
    return 0


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("render", "print the RayCluster and Ray job a TPUFineTune would produce "
                         "(validated exactly as the operator does); no cluster needed",
               _render_arguments, _render),
    Subcommand("run", "run a TPUFineTune spec on a local Ray head, without Kubernetes "
                      "(same validation, sizing, entrypoint and event parsing)",
               _run_arguments, _run),
    Subcommand("operator", "start the operator (kopf) against the current kubeconfig "
                           "or in-cluster credentials",
               _operator_arguments, _operator),
    Subcommand("plot", "write a PNG of a TPUFineTune's training loss, eval loss and "
                       "learning rate against the step (needs the plot extra)",
               _plot_arguments, _plot),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpufinetune", description="Fine-tune LLMs on Cloud TPU slices from Kubernetes.")
    parser.add_argument("--version", action="version", version=f"tpufinetune {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(handler=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
