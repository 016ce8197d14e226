"""The suite starts with its longest files (tests/lanes.py): a renamed or removed file must not drop out silently."""
from pathlib import Path

from lanes import LONGEST_FIRST, longest_first

ROOT = Path(__file__).resolve().parents[1]


def test_every_file_named_longest_first_exists():
    missing = [path for path in LONGEST_FIRST if not (ROOT / path).is_file()]
    assert missing == [], f"tests/lanes.py's LONGEST_FIRST names files that are not there: {missing}"


def test_tests_of_the_longest_files_sort_first_in_their_order_and_the_rest_keep_theirs():
    ids = ["tests/test_block_allocator.py::test_a", f"{LONGEST_FIRST[1]}::test_b", "notebooks/00.ipynb::Cell 0",
           f"{LONGEST_FIRST[0]}::TestX::test_c", f"{LONGEST_FIRST[0][:-3]}_extra.py::test_d"]
    assert sorted(ids, key=longest_first) == [ids[3], ids[1], ids[0], ids[2], ids[4]]
