"""Render benchmark rows (a list of dicts) as a Markdown table."""
from __future__ import annotations


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    return "" if v is None else str(v)


def markdown_table(rows: list[dict]) -> str:
    """One column per key; list values (e.g. a kernel launch sequence) stay in the JSON, out of the table."""
    cols: list[str] = []
    for row in rows:
        cols += [c for c, v in row.items() if c not in cols and not isinstance(v, list)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)
