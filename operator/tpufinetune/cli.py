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


def _logs_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the TPUFineTune's name")
    parser.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig "
                                                  "context's, else default)")
    parser.add_argument("--attempt", type=int, help="attempt number, from 1 (default: the current one)")
    parser.add_argument("--worker", type=int, metavar="K",
                        help="Ray Train worker K's output (world rank) instead of the driver's")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="keep printing what the attempt writes until it has ended")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default $KUBECONFIG or "
                                             "~/.kube/config)")


def _logs(args: argparse.Namespace) -> int:
    if args.attempt is not None and args.attempt < 1:
        print("tpufinetune logs: --attempt must be 1 or more", file=sys.stderr)
        return EXIT_INVALID
    if args.worker is not None and args.worker < 0:
        print("tpufinetune logs: --worker must be a world rank, 0 or more", file=sys.stderr)
        return EXIT_INVALID
    from .adapters import runlogs

    try:
        import pyarrow.fs  # noqa: F401 - the bucket's client, the trainer's own

        from .adapters.readrun import read_tpufinetune
    except ImportError as exc:
        print(f"tpufinetune logs: {exc.name or exc} is not installed: {runlogs.EXTRA_HINT}", file=sys.stderr)
        return EXIT_INVALID
    what = f"tpufinetune {args.namespace + '/' if args.namespace else ''}{args.name}"
    try:
        namespace, obj = read_tpufinetune(args.name, args.namespace, args.kubeconfig)
        what = f"tpufinetune {namespace}/{args.name}"
        number, entry = runlogs.attempt_of(obj, args.attempt)
        uri = runlogs.logs_uri_of(obj, number, entry)
    except LookupError as exc:
        print(f"tpufinetune logs: {what}: {exc}", file=sys.stderr)
        return 1

    def now() -> dict | None:
        """The resource now; None once deleted; {} (not ended) when it cannot be read now."""
        try:
            return read_tpufinetune(args.name, namespace, args.kubeconfig)[1]
        except LookupError as exc:
            return None if "not found" in str(exc) else {}

    stream = runlogs.stream_name(args.worker)
    try:
        wrote = runlogs.show(uri, stream, runlogs.stdout_bytes, follow=args.follow, read_obj=now, number=number)
    except KeyboardInterrupt:
        return 130
    except (LookupError, OSError) as exc:
        print(f"tpufinetune logs: {what}: attempt {number}: {uri}: {exc}", file=sys.stderr)
        return 1
    if not wrote:
        print(f"tpufinetune logs: {what}: attempt {number} has no {stream} log at {uri}/{stream} "
              f"(streams kept: {runlogs.available(uri)})", file=sys.stderr)
        return 1
    return 0


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the TPUFineTune's name")
    parser.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig "
                                                  "context's, else default)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default $KUBECONFIG or "
                                             "~/.kube/config)")
    parser.add_argument("--samples", action="store_true",
                        help="print an epoch's generation samples (prompt, reference, answer) from the "
                             "run's storage instead of the table (needs the logs extra)")
    parser.add_argument("--epoch", type=int, help="with --samples: the epoch (default: the last that has them)")
    parser.add_argument("--limit", type=int, metavar="K", help="with --samples: only the first K")
    parser.add_argument("--json", action="store_true", help="with --samples: the JSON lines as stored")


def _eval_refusal(args: argparse.Namespace) -> str:
    """Why the options cannot go together, before reaching anything; '' when they can."""
    if not args.samples and (args.epoch is not None or args.limit is not None or args.json):
        return "--epoch, --limit and --json go with --samples"
    if args.epoch is not None and args.epoch < 1:
        return "--epoch must be 1 or more"
    if args.limit is not None and args.limit < 1:
        return "--limit must be 1 or more"
    return ""


def _eval(args: argparse.Namespace) -> int:
    from .evaltable import evaluation_table, lm_eval_table

    refusal = _eval_refusal(args)
    if refusal:
        print(f"tpufinetune eval: {refusal}", file=sys.stderr)
        return EXIT_INVALID
    try:
        if args.samples:
            import pyarrow.fs  # noqa: F401 - the bucket's client, the trainer's own

        from .adapters.readrun import read_tpufinetune
    except ImportError as exc:
        from .adapters.runlogs import EXTRA_HINT

        print(f"tpufinetune eval: {exc.name or exc} is not installed: {EXTRA_HINT}", file=sys.stderr)
        return EXIT_INVALID
    try:
        namespace, obj = read_tpufinetune(args.name, args.namespace, args.kubeconfig)
    except LookupError as exc:
        print(f"tpufinetune eval: {exc}", file=sys.stderr)
        return 1
    if args.samples:
        return _eval_samples(args, f"{namespace}/{args.name}", obj.get("status") or {})
    table, note = evaluation_table(obj.get("status") or {})
    sys.stdout.write(table + "\n" + lm_eval_table(obj.get("status") or {}))
    if note:
        print(f"tpufinetune eval: {namespace}/{args.name}: {note}", file=sys.stderr)
    return 0


def _eval_samples(args: argparse.Namespace, what: str, status: dict) -> int:
    """An epoch's generation samples, read from the URI its status names."""
    from .adapters.runlogs import read_text
    from .evalsamples import first_lines, parse_samples, samples_epoch, samples_listing

    try:
        epoch, uri = samples_epoch(status.get("history"), args.epoch)
    except LookupError as exc:
        print(f"tpufinetune eval: {what}: {exc}", file=sys.stderr)
        return 1
    try:
        text = read_text(uri)
        if args.json:
            output = first_lines(text, args.limit)
        else:
            output = samples_listing(epoch, uri, parse_samples(text), args.limit)
    except (OSError, ValueError) as exc:
        print(f"tpufinetune eval: {what}: epoch {epoch}: cannot read {uri}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(output)
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
    Subcommand("logs", "print an attempt's driver (or a worker's) log from the run's "
                       "storage, live or after its RayCluster is gone (needs the logs extra)",
               _logs_arguments, _logs),
    Subcommand("eval", "print a TPUFineTune's evaluation per epoch (eval loss and generation "
                       "metrics) and lm-eval's on its export from its status, or with --samples an "
                       "epoch's prompts, references "
                       "and answers from the run's storage (needs the logs extra)",
               _eval_arguments, _eval),
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
