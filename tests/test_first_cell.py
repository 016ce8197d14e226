"""The notebooks' first cell outside a clone: it installs kvlib once, from the configured source, then reuses it,
and with no source it stops and says where to put one.

The tests run the first cell in a fresh folder, in a Python that cannot see the development
install: with ``KVLIB_SOURCE`` pointing at a wheel of this checkout, as a learner's Colab runtime
would, except that pip installs into a folder of the test (``PIP_TARGET``); and with nothing.
tests/test_fresh_install.py runs whole lessons from the workshop kit in a fresh environment.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvlib.cli.kit import build_wheel
from kvlib.course.notebook_setup import FIRST_CELL, WHEEL_PATTERN

ROOT = Path(__file__).resolve().parents[1]
WITHOUT_THE_DEV_INSTALL = ("import sys\n"
                           "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in str(f)]\n"
                           f"sys.path[:] = [p for p in sys.path if not p.startswith({str(ROOT)!r})]\n")


def test_the_first_cell_installs_kvlib_from_the_configured_source_once(tmp_path):
    wheel = build_wheel(ROOT, tmp_path / "wheels")
    site, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "KVLIB_SOURCE": str(wheel), "PIP_TARGET": str(site), "PIP_NO_DEPS": "1",
           "PYTHONPATH": str(site), "MPLBACKEND": "Agg"}
    cell = WITHOUT_THE_DEV_INSTALL + FIRST_CELL + "\nimport kvlib; print('loaded', kvlib.__file__)\n"
    twice = cell + "\n" + FIRST_CELL + "\n"
    result = subprocess.run([sys.executable, "-c", twice], cwd=work, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(f"installing kvlib from {wheel}") == 1  # the second run found it installed
    assert f"loaded {site}" in result.stdout and "attention backend" in result.stdout


def test_the_first_cell_with_no_source_and_no_wheel_says_where_to_put_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVLIB_SOURCE"}
    result = subprocess.run([sys.executable, "-c", WITHOUT_THE_DEV_INSTALL + FIRST_CELL], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "installing" not in result.stdout
    message = " ".join(result.stderr.split())
    assert f"Upload the workshop kit's kvlib wheel ({WHEEL_PATTERN}) to {tmp_path}" in message, result.stderr
    assert "set KVLIB_SOURCE" in message
