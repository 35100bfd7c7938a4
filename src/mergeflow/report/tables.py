"""Tables as text: aligned columns for a terminal, or Markdown."""

from __future__ import annotations


def render(table: list[list[str]], markdown: bool = False, align: str | None = None) -> str:
    """``table``: rows of cells, the header first; ``align``: "l" or "r" per column (default: the first column
    left, the others right)."""
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    align = align or "l" + "r" * (len(widths) - 1)

    def fit(cell: str, c: int) -> str:
        return cell.ljust(widths[c]) if align[c] == "l" else cell.rjust(widths[c])

    if markdown:
        lines = ["| " + " | ".join(fit(cell, c) for c, cell in enumerate(row)) + " |" for row in table]
        rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else "-" * (w + 2) for w, a in zip(widths, align)) + "|"
        return "\n".join([lines[0], rule, *lines[1:]])
    return "\n".join("  ".join(fit(cell, c) for c, cell in enumerate(row)).rstrip() for row in table)
