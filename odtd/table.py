"""Text tables: every table ``odtctl`` prints, and the profile a written policy carries as comments.

One function aligns the columns, so a table's width follows what is in it rather than widths
guessed per command. Standard library only and importing nothing of odtd: ``profiling`` (the
profile table in a policy file's comments) uses it below ``report`` and ``cli``.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence


def table(rows: Iterable[Sequence[object]], headers: Optional[Sequence[str]] = None,
          align: str = "", gap: str = "  ", indent: str = "") -> list[str]:
    """Align ``rows`` (and ``headers`` above them) into columns; return the text lines.

    Args:
        rows: the cells of each row; each is shown as ``str(cell)``, None as ``-``. A row may
            be shorter than the others (its missing cells are empty).
        headers: the first line, aligned as the cells; None = no header line.
        align: one ``<`` (left) or ``>`` (right) per column; columns past its end are left
            aligned. Numbers read best right-aligned.
        gap: what separates two columns.
        indent: what starts every line.

    Returns:
        One string per line, without trailing spaces.
    """
    text = [["-" if cell is None else str(cell) for cell in row] for row in rows]
    if headers is not None:
        text.insert(0, list(headers))
    count = max((len(row) for row in text), default=0)
    widths = [max((len(row[i]) for row in text if i < len(row)), default=0) for i in range(count)]
    sides = align.ljust(count, "<")
    return [(indent + gap.join(cell.rjust(width) if side == ">" else cell.ljust(width)
                               for cell, width, side in zip(row, widths, sides))).rstrip()
            for row in text]
