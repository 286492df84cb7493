"""What create_space refuses, computed without creating: for callers that
check their options first (FlexInfer, before it loads the weights) and for
vtmd, which gives each client's spaces together one page-table budget.
The numbers are the C++ manager's (Manager::kMaxSpaceBytes and the page
table's, manager.h)."""

from __future__ import annotations

from vtm._core import _MIN_TABLE_ENTRIES, _SLOT_TABLE_ENTRIES, _TABLE_ENTRIES_PER_CHUNK, MAX_SPACE_BYTES


def slot_bytes(row_bytes: int, max_tokens: int, chunk_bytes: int) -> int:
    """A slot's address range: its rows rounded up to whole chunks."""
    return -(-row_bytes * max_tokens // chunk_bytes) * chunk_bytes


def page_table_entries(row_bytes: int, max_tokens: int, max_slots: int, chunk_bytes: int) -> int:
    """The entries of a space's page table (a slot's bookkeeping counted as entries too)."""
    return max_slots * (slot_bytes(row_bytes, max_tokens, chunk_bytes) // chunk_bytes + _SLOT_TABLE_ENTRIES)


def page_table_budget(capacity_bytes: int, chunk_bytes: int) -> int:
    """The most page-table entries a space may have in a pool of this capacity."""
    return max(_MIN_TABLE_ENTRIES, _TABLE_ENTRIES_PER_CHUNK * (capacity_bytes // chunk_bytes))


__all__ = ["MAX_SPACE_BYTES", "page_table_budget", "page_table_entries", "slot_bytes"]
