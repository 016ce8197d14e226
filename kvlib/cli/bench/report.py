"""One plain-text table format for every benchmark, so results read the same in a terminal and in BENCHMARKS.md."""
from __future__ import annotations


def _cell(value) -> str:
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


def format_table(rows: list[dict], title: str) -> str:
    """Rows as aligned columns under ``title``: numbers right-aligned, text left-aligned.

    Columns are the rows' keys in order of first appearance; a row without a key leaves that cell empty.
    """
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(row.get(c), (int, float)) and not isinstance(row.get(c), bool)
                   for row in rows if row.get(c) is not None) for c in columns]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(columns), rule] + [line(values) for values in cells])
