import sys
from pathlib import Path

import pytest

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
