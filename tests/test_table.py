"""The one table printer every text table goes through (odtd.table)."""

from odtd.table import table


def test_columns_take_the_width_of_their_widest_cell_and_align_as_asked():
    lines = table([(1, "tinycnn", 2.5), (128, "densenet40", None)], ("batch", "model", "J"),
                  align="><>")
    assert lines == [
        "batch  model         J",
        "    1  tinycnn     2.5",
        "  128  densenet40    -",
    ]


def test_no_header_short_rows_indent_gap_and_no_trailing_spaces():
    lines = table([("a", "open", ""), ("longer", "CLOSED")], gap=" ", indent="  ")
    assert lines == ["  a      open", "  longer CLOSED"]
    assert table([]) == [] and table([], ("x", "y")) == ["x  y"]
