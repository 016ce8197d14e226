import os
import sys
from pathlib import Path

# One torch thread in every test worker and in every kernel and sandbox it starts (they inherit it):
# they run side by side on the cores, and torch's CPU kernels slow down sharply when their threads
# outnumber the free cores (two lab kernels at once took 106 s with torch's default against 47 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# No timing thresholds in tests: an example's duration depends on what else shares the cores.
settings.register_profile("kvlib", deadline=None)
settings.load_profile("kvlib")

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import write_checkpoint  # noqa: E402
from lanes import RUNS_NOTEBOOKS, SLOW, longest_first  # noqa: E402


def _names(item: pytest.Item) -> tuple[Path, str]:
    path = Path(str(item.path))
    return path, f"{path.name}::{getattr(item, 'originalname', item.name)}"


def runs_notebooks(item: pytest.Item) -> bool:
    path, test = _names(item)
    return (path.suffix == ".ipynb" or path.name in RUNS_NOTEBOOKS or test in RUNS_NOTEBOOKS
            or path.name.startswith("test_grading"))


def is_slow(item: pytest.Item) -> bool:
    path, test = _names(item)
    return path.name in SLOW or test in SLOW


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: an engine test too long for the fast lane (tests/lanes.py's SLOW); "
                                       "-m 'not notebooks and not slow' is the fast lane")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if runs_notebooks(item):
            item.add_marker(pytest.mark.notebooks)
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: longest_first(item.nodeid))  # stable: each file keeps its own order


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(arch)`` -> folder of a tiny random checkpoint, written once per session."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = write_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]
    return get
