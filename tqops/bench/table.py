"""Render benchmark rows (a list of dicts) as a Markdown table."""
from __future__ import annotations


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    return "" if v is None else str(v)


def markdown_table(rows: list[dict]) -> str:
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)
