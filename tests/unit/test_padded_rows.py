"""The row counts a packed bf16 product runs at (workers/models/packed.py, `padded_rows`): few
enough that oneDNN's kernels, one per row count, are built once and kept, and never more than an
AMX tile's worth of rows, or a 32nd of the rows, beyond what was asked."""

from __future__ import annotations

from workers.models.packed import TILE_ROWS, padded_rows

# The longest pass the CPU planner makes is well under this many rows (texts x padded tokens).
MOST_ROWS = 8192


def test_every_row_count_runs_at_a_whole_number_of_tiles_with_little_padding() -> None:
    for rows in range(1, MOST_ROWS + 1):
        padded = padded_rows(rows)
        assert padded >= rows and padded % TILE_ROWS == 0, rows
        assert padded - rows < TILE_ROWS or padded - rows <= rows / 32, (rows, padded)


def test_row_counts_up_to_8192_come_down_to_160_kernels_a_weight() -> None:
    assert len({padded_rows(rows) for rows in range(1, MOST_ROWS + 1)}) == 160


def test_a_whole_step_is_its_own_row_count() -> None:
    assert [padded_rows(rows) for rows in (16, 512, 1024, 8192)] == [16, 512, 1024, 8192]
    assert [padded_rows(rows) for rows in (1, 17, 513, 1025)] == [16, 32, 528, 1056]
