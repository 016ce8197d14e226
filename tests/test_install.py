"""README.md's install block is what CI runs, and it installs the CPU build of torch before kvlib."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_TORCH = 'pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu'


def readme_install_block() -> list[str]:
    """The commands of the first bash block under "## Install", comments and blank lines left out."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```bash\n(.*?)^```$", section, re.S | re.M).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_install_block_as_written():
    printed = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-install"], capture_output=True,
                             text=True, check=True).stdout.splitlines()
    assert printed == readme_install_block()


def test_ci_installs_nothing_of_its_own_besides_pip_and_debian_packages():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    own = [line for line in lines if re.search(r"\bpip\b.*\binstall\b", line) and not line.startswith("#")]
    assert own == ["python -m pip install -q --upgrade pip"]


def test_the_cpu_torch_line_comes_first_and_says_it_is_for_cpu_only_machines():
    commands = [line.split("#")[0].strip() for line in readme_install_block()]
    assert commands[0] == CPU_TORCH and "CPU-only" in readme_install_block()[0]
    assert 'pip install -e ".[dev]"' in commands[1:]


def test_the_readme_promises_no_package_that_an_index_does_not_hold():
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"pip install [\"']?kvlib\b", readme)
    assert "git+" not in readme


def test_the_kernel_is_registered_in_this_environment_not_over_the_users_python3():
    """``--user --name python3`` replaced the python3 kernel of every Jupyter the user has with this environment's."""
    kernel = [line for line in readme_install_block() if "ipykernel install" in line]
    assert kernel == ["python -m ipykernel install --sys-prefix"]
    conda = (ROOT / "environment.yml").read_text()
    assert "ipykernel install --sys-prefix" in conda and "--user" not in conda


def test_the_readmes_first_snippet_run_as_a_script_saves_its_picture(tmp_path):
    """In a script, ``llm.metrics.plot()`` showed and saved nothing; the snippet must leave what it promises."""
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"^```python\n(.*?)^```$", readme, re.S | re.M).group(1)
    assert "plot(" in snippet
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"})
    assert done.returncode == 0, done.stderr[-2000:]
    pictures = list(tmp_path.glob("*.png"))
    assert len(pictures) == 1 and pictures[0].stat().st_size > 0
