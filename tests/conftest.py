import os
import sys
from pathlib import Path

# One torch thread in this process and in every kernel and sandbox it starts (they inherit it):
# several of them run at once on two cores, and torch's CPU kernels slow down sharply when their
# threads outnumber the free cores (labs run two at a time took 106 s this way against 47 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# No timing thresholds in tests: an example's duration depends on what else shares the cores.
settings.register_profile("kvlib", deadline=None)
settings.load_profile("kvlib")

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """``checkpoint(arch)`` -> folder of a tiny random checkpoint, written once per session."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = write_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]
    return get
