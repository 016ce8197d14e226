"""The ``kvlib`` command: demo, serve, bench, grade, make-labs, make-kit, record-run."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import fields
from pathlib import Path

BENCHES = ("memory", "kernels", "swap", "preemption", "sharing", "scheduler", "engine", "serve", "peers")


def _demo(args) -> int:
    from kvlib.cli.demo import DemoOptions, run_demo
    run_demo(DemoOptions(**{f.name: getattr(args, f.name) for f in fields(DemoOptions)}))
    return 0


def _serve(args) -> int:
    from kvlib.serve.command import run
    return run(args)


def _bench(args) -> int:
    """Each benchmark is a module ``kvlib.cli.bench.NAME`` whose ``main(argv)`` prints its tables."""
    names = [n for n in BENCHES if importlib.util.find_spec(f"kvlib.cli.bench.{n}")] if args.name == "all" else [args.name]
    status = 0
    for name in names:
        status |= importlib.import_module(f"kvlib.cli.bench.{name}").main(args.rest)
        print()
    return status


def _grade(args) -> int:
    from kvlib.course.grading.report import write_gradebook, write_gradescope
    from kvlib.course.grading.runner import grade_folder, grade_notebook
    from kvlib.course.grading.sandbox import Limits
    path = Path(args.path)
    limits = Limits(check_scale=args.time_scale, submission_s=args.budget)
    if path.is_dir():
        if args.format == "gradescope":
            print("kvlib grade: --format gradescope grades one notebook (Gradescope runs one submission at a time)",
                  file=sys.stderr)
            return 2
        reports = grade_folder(path, args.lab, args.jobs, limits)
        if not reports:
            print(f"kvlib grade: {path} holds no .ipynb submissions", file=sys.stderr)
            return 2
        out = write_gradebook(reports, args.csv or path / "gradebook.csv")
        for report in reports:
            print(f"{report.notebook.name:40s} {report.points:4d} / {report.max_points}")
        print(f"gradebook: {out}")
        return 0
    if not path.is_file():
        print(f"kvlib grade: {path} is not a file or folder; pass a lab notebook, e.g. labs/lab02_allocator.ipynb, "
              f"or a folder of submissions", file=sys.stderr)
        return 2
    try:
        report = grade_notebook(path, args.lab, limits)
    except ValueError as exc:
        print(f"kvlib grade: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if args.format == "gradescope":
        print(f"results: {write_gradescope(report, args.output or 'results.json')}")
    return 0 if report.full_marks else 1


def _make_labs(args) -> int:
    from kvlib.course.labs import LabError, make_labs
    try:
        written = make_labs(args.solutions, args.labs)
    except LabError as exc:
        print(f"kvlib make-labs: {exc}; nothing was written", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


class DescribedDefaults(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its description, and the description's own line breaks kept."""


def _make_kit(args) -> int:
    from kvlib.cli.kit import NotAClone, handout, make_kit
    try:
        wheel, notebooks = make_kit(Path(args.out))
    except NotAClone as exc:
        print(f"kvlib make-kit: {exc}", file=sys.stderr)
        return 2
    print(handout(wheel, notebooks))
    return 0


def _record_run(args) -> int:
    from kvlib.course.measured_runs import measure_run, save_run
    run = measure_run(args.name, args.model)
    save_run(run, args.file)
    print(f"recorded {run.name!r} ({run.device}, {run.model}, {run.dtype}) in {args.file}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvlib.cli import demo as demo_module
    parser = argparse.ArgumentParser(prog="kvlib", description="A paged-KV inference engine and its course.")
    commands = parser.add_subparsers(dest="command", required=True, help="what to run")

    demo = commands.add_parser("demo", help="serve a workload through a small KV pool and report preemptions",
                               description=demo_module.ABOUT,
                               formatter_class=DescribedDefaults)
    for option in fields(demo_module.DemoOptions):
        choices = ("recompute", "swap", "auto") if option.name == "preemption_mode" else None
        demo.add_argument(f"--{option.name.replace('_', '-')}", dest=option.name, type=type(option.default),
                          default=option.default, choices=choices, help=option.metadata["help"])
    demo.set_defaults(run=_demo)

    from kvlib.serve import command as serve_command
    serve = commands.add_parser("serve", help="serve a model over HTTP with OpenAI's API, with Prometheus metrics",
                                description=serve_command.ABOUT, formatter_class=DescribedDefaults)
    serve_command.add_arguments(serve)
    serve.set_defaults(run=_serve)

    bench = commands.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("name", choices=BENCHES + ("all",), help="which benchmark (all: each in turn)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see kvlib bench NAME --help)")
    bench.set_defaults(run=_bench)

    grade = commands.add_parser("grade", help="grade a lab notebook (or a folder of submissions into a gradebook)")
    grade.add_argument("path", help="a lab notebook, or a folder of submitted notebooks")
    grade.add_argument("--lab", help="the lab, e.g. lab02, when the file names do not say")
    grade.add_argument("--jobs", type=int, default=2, help="submissions graded at once (a folder)")
    grade.add_argument("--csv", help="the gradebook's file path, e.g. marks.csv (default: PATH/gradebook.csv)")
    grade.add_argument("--format", choices=("table", "gradescope"), default="table",
                       help="gradescope: also write Gradescope's results.json for one notebook")
    grade.add_argument("--output", help="where --format gradescope writes (default: results.json)")
    grade.add_argument("--time-scale", type=float, default=1.0, help="multiply every check's time limit")
    grade.add_argument("--budget", type=float, default=600.0,
                       help="seconds all of one submission's checks may take together (scaled by --time-scale); "
                            "each task has a share, by its checks' time limits, that caps a check and, after a "
                            "hang, the task")
    grade.set_defaults(run=_grade)

    labs = commands.add_parser("make-labs", help="generate labs/ from solutions/")
    labs.add_argument("--solutions", default="solutions", help="the folder of instructor notebooks to read")
    labs.add_argument("--labs", default="labs", help="the folder of student labs to replace")
    labs.set_defaults(run=_make_labs)

    kit = commands.add_parser("make-kit", help="build the workshop kit: kvlib's wheel beside the lessons and labs")
    kit.add_argument("out", help="the folder to write the kit into (created if missing)")
    kit.set_defaults(run=_make_kit)

    from kvlib.course.measured_runs import RUNS_PATH
    record = commands.add_parser("record-run", help="measure this machine's swap and recompute costs for lessons 07 and 09",
                                 formatter_class=DescribedDefaults)
    record.add_argument("--name", required=True, help="what the machine is, e.g. 'H200 SXM, <provider>'")
    record.add_argument("--model", default="smollm2-135m", help="the model to measure with (a catalog name or a folder)")
    record.add_argument("--file", type=Path, default=RUNS_PATH, help="the file of recorded runs to append to")
    record.set_defaults(run=_record_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
