"""The ``kvlib`` command: demo, bench, grade, make-labs."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import fields

BENCHES = ("memory", "kernels", "swap", "preemption", "sharing", "scheduler", "engine")


def _demo(args) -> int:
    from kvlib.cli.demo import DemoOptions, run_demo
    run_demo(DemoOptions(**{f.name: getattr(args, f.name) for f in fields(DemoOptions)}))
    return 0


def _bench(args) -> int:
    """Each benchmark is a module ``kvlib.cli.bench.NAME`` whose ``main(argv)`` prints its tables."""
    names = [n for n in BENCHES if importlib.util.find_spec(f"kvlib.cli.bench.{n}")] if args.name == "all" else [args.name]
    status = 0
    for name in names:
        status |= importlib.import_module(f"kvlib.cli.bench.{name}").main(args.rest)
        print()
    return status


def _grade(args) -> int:
    from pathlib import Path

    from kvlib.course.grading import grade_notebook
    if not Path(args.notebook).is_file():
        print(f"kvlib grade: {args.notebook} is not a file; pass the path of a lab notebook, "
              f"e.g. labs/lab02_allocator.ipynb", file=sys.stderr)
        return 2
    report = grade_notebook(args.notebook)
    print(report.table())
    return 0 if report.full_marks else 1


def _make_labs(args) -> int:
    from kvlib.course.labs import make_labs
    for path in make_labs(args.solutions, args.labs):
        print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlib", description="A paged-KV inference engine and its course.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="serve a workload through a small KV pool and report preemptions")
    defaults = {f.name: f.default for f in fields(__import__("kvlib.cli.demo", fromlist=["DemoOptions"]).DemoOptions)}
    for name, default in defaults.items():
        choices = ("recompute", "swap", "auto") if name == "preemption_mode" else None
        demo.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(default), default=default, choices=choices)
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="run a benchmark and print its table")
    bench.add_argument("name", choices=BENCHES + ("all",))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see kvlib bench NAME --help)")
    bench.set_defaults(run=_bench)

    grade = commands.add_parser("grade", help="execute a lab notebook and print its score table")
    grade.add_argument("notebook")
    grade.set_defaults(run=_grade)

    labs = commands.add_parser("make-labs", help="generate labs/ from solutions/")
    labs.add_argument("--solutions", default="solutions")
    labs.add_argument("--labs", default="labs")
    labs.set_defaults(run=_make_labs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
