"""Mutation testing of the engine's core: how many single-operator changes do the fast tests notice?

A developer's tool, not CI. It copies ``kvlib/`` and ``tests/`` into a scratch folder (the working
tree is never touched), has mutmut write every mutant of the modules named, runs a seeded sample
of them one at a time against the fast core tests, and prints the kill rate per module and every
mutant that survived (file, line, what changed). ``pip install -e ".[mutation]"`` brings mutmut;
the tool needs Python 3.11 or newer (it reads pyproject.toml with ``tomllib``).

    python tools/mutation.py --sample 150 --seed 1
    python tools/mutation.py kvlib/core/sharing.py --sample 20 --seed 2 --tests tests/test_sharing.py
    python tools/mutation.py --at HEAD --sample 150 --seed 1   # the committed package, today's tests

The modules and tests default to ``[tool.mutmut]`` in pyproject.toml (``only_mutate`` and
``pytest_add_cli_args_test_selection``), so the list has one owner.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A mutant is caught when a test fails, or when the tests stop ending: a mutant that turns a loop
# endless (a pool that never frees room, a queue never empty) is caught by mutmut's time limit.
CAUGHT = {"killed", "timeout"}
PYTEST_ARGS = ["-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:xdist", "-x", "-q"]
# mutmut has no command that only writes the mutants, so they are written with its own functions (the
# mutation extra pins the minor version these names come from).
GENERATE = ("from mutmut.__main__ import create_mutants\n"
            "from mutmut.utils.file_utils import copy_src_dir, copy_also_copy_files\n"
            "copy_src_dir(); copy_also_copy_files(); create_mutants(1)\n")


@dataclass
class Survivor:
    name: str
    file: str
    line: int
    before: str
    after: str


def defaults() -> dict:
    """The modules and tests named in pyproject.toml's [tool.mutmut]."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]


def prepare(scratch: Path, modules: list[str], tests: list[str], revision: str | None) -> None:
    """Copy the package (as committed at ``revision``, else as it is) and the tests into
    ``scratch``, with a mutmut config for these modules."""
    packages = sorted({Path(m).parts[0] for m in modules})
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "mutants")
    shutil.copytree(REPO / "tests", scratch / "tests", ignore=ignore)
    for package in packages:
        if revision:
            archive = subprocess.run(["git", "archive", revision, package], cwd=REPO,
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
        else:
            shutil.copytree(REPO / package, scratch / package, ignore=ignore)
    config = {"source_paths": packages, "only_mutate": modules,
              "pytest_add_cli_args": PYTEST_ARGS, "pytest_add_cli_args_test_selection": tests,
              "process_isolation": "forkserver", "use_git_change_detection": False}
    lines = ["[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in config.items()]
    (scratch / "pyproject.toml").write_text("\n".join(lines) + "\n")


def generate(scratch: Path, modules: list[str]) -> dict[str, list[str]]:
    """Have mutmut write every mutant; return their names by module."""
    subprocess.run([sys.executable, "-c", GENERATE], cwd=scratch, check=True,
                   stdout=subprocess.DEVNULL)
    return {module: sorted(exit_codes(scratch, module)) for module in modules}


def exit_codes(scratch: Path, module: str) -> dict[str, int | None]:
    meta = json.loads((scratch / "mutants" / f"{module}.meta").read_text())
    return meta["exit_code_by_key"]


def draw(names_by_module: dict[str, list[str]], size: int, seed: int) -> list[str]:
    """A uniform sample over all mutants of all modules, the same for the same seed and code."""
    everything = [name for names in names_by_module.values() for name in names]
    return sorted(random.Random(seed).sample(everything, min(size, len(everything))))


def run_mutants(scratch: Path, names: list[str]) -> None:
    """One mutant at a time (``--max-children 1``): the cores are shared."""
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "1", *names],
                         cwd=scratch, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"mutmut stopped before the mutants ran (do the tests pass on the unmutated "
                 f"package?):\n{run.stdout[-2000:]}{run.stderr[-2000:]}")


def changed_line(scratch: Path, module: str, name: str) -> Survivor:
    """Where a mutant changes its module, read from mutmut's diff of the mutated function."""
    diff = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=scratch, capture_output=True,
                          text=True).stdout.splitlines()
    before = next((d[1:].strip() for d in diff if d.startswith("-") and not d.startswith("---")), "")
    after = next((d[1:].strip() for d in diff if d.startswith("+") and not d.startswith("+++")), "")
    return Survivor(name, module, line_of(scratch / module, function_of(name), before), before, after)


def function_of(name: str) -> str:
    """``kvlib.m.xǁClassǁmethod__mutmut_3`` -> ``method``; ``kvlib.m.x_func__mutmut_1`` -> ``func``."""
    mangled = name.rsplit(".", 1)[-1].split("__mutmut_")[0]
    return mangled.split("ǁ")[-1] if "ǁ" in mangled else mangled.removeprefix("x_")


def line_of(path: Path, function: str, text: str) -> int:
    """The first line of ``function`` in ``path`` whose text is ``text`` (0 where none is)."""
    source = path.read_text().splitlines()
    for node in ast.walk(ast.parse("\n".join(source))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            for number in range(node.lineno, node.end_lineno + 1):
                if source[number - 1].strip() == text:
                    return number
    return 0


def report(scratch: Path, sample: list[str], names_by_module: dict[str, list[str]]) -> None:
    """Print the kill rate per module (a timeout counts as a kill, and is counted apart) and the survivors."""
    from mutmut.stats import status_by_exit_code

    killed, timeouts, total, survivors = Counter(), Counter(), Counter(), []
    for module, names in names_by_module.items():
        codes = exit_codes(scratch, module)
        for name in set(sample) & set(names):
            status = status_by_exit_code[codes[name]]
            total[module] += 1
            killed[module] += status in CAUGHT
            timeouts[module] += status == "timeout"
            if status not in CAUGHT:
                survivors.append((status, changed_line(scratch, module, name)))
    print(f"{'module':<28} {'mutants':>8} {'killed':>7} {'of them by timeout':>19} {'rate':>6}")
    for module in names_by_module:
        rate = killed[module] / total[module] if total[module] else float("nan")
        print(f"{module:<28} {total[module]:>8} {killed[module]:>7} {timeouts[module]:>19} {rate:>6.0%}")
    overall = sum(killed.values()) / max(1, sum(total.values()))
    print(f"{'all':<28} {sum(total.values()):>8} {sum(killed.values()):>7} {sum(timeouts.values()):>19} "
          f"{overall:>6.0%}")
    if survivors:
        print("\nsurvivors:")
    for status, s in sorted(survivors, key=lambda pair: (pair[1].file, pair[1].line)):
        print(f"  {s.file}:{s.line}  {s.before}  ->  {s.after}   ({status}: {s.name})")


def main(argv: list[str] | None = None) -> int:
    config = defaults()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=config["only_mutate"],
                        help="modules to mutate, as paths from the repository root")
    parser.add_argument("--tests", nargs="+", default=config["pytest_add_cli_args_test_selection"],
                        help="test files run against each mutant")
    parser.add_argument("--sample", type=int, default=150, help="how many mutants to run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--at", metavar="REVISION",
                        help="mutate the package as committed at REVISION (default: the working tree)")
    parser.add_argument("--keep", type=Path, help="a new folder to work in and keep (default: a temporary one)")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="kvlib-mutation-"))
    try:
        prepare(scratch, args.modules, args.tests, args.at)
        names_by_module = generate(scratch, args.modules)
        sample = draw(names_by_module, args.sample, args.seed)
        print(f"{sum(map(len, names_by_module.values()))} mutants, running {len(sample)} "
              f"(seed {args.seed}) against {' '.join(args.tests)}")
        run_mutants(scratch, sample)
        report(scratch, sample, names_by_module)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
