"""The segment layout is pure arithmetic: check its invariants directly."""

import pytest

from mpexec.ipc import layout
from mpexec.ipc.layout import RingLayout


@pytest.mark.parametrize("readers", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("chunks,chunk_bytes", [(1, 1024), (8, 512 * 1024), (10, 4000)])
def test_regions_do_not_overlap(readers: int, chunks: int, chunk_bytes: int) -> None:
    geo = RingLayout(readers, chunks, chunk_bytes)
    control_end = layout.WRITER_WAITING_CELL + 1
    reader_cells = {geo.reader_cell(r, f) for r in range(readers)
                    for f in (layout.READ_SEQ, layout.SLEEPING, layout.PID, layout.STATE)}
    release_cells = {geo.release_cell(r, s) for r in range(readers)
                     for s in range(layout.BULK_SLOTS)}
    assert min(reader_cells) >= control_end
    assert not reader_cells & release_cells
    assert max(reader_cells | release_cells) * 8 + 8 <= geo.ring_offset
    assert geo.ring_offset % layout.PAGE == 0
    assert geo.chunk_offset(0) == geo.ring_offset
    last = geo.chunk_offset(chunks - 1)
    assert last + layout.CHUNK_HEADER + chunk_bytes <= geo.total_bytes
    assert geo.total_bytes % layout.PAGE == 0


def test_counters_sit_on_their_own_lines() -> None:
    geo = RingLayout(4, 8, 4096)
    lines = [layout.WRITE_SEQ_CELL // 8, layout.WRITER_WAITING_CELL // 8]
    lines += [geo.reader_cell(r, layout.READ_SEQ) // 8 for r in range(4)]
    assert len(set(lines)) == len(lines)
    assert 0 not in lines  # the control line is never written on the hot path


def test_message_k_uses_chunk_k_mod_ring() -> None:
    geo = RingLayout(1, 4, 1024)
    assert geo.chunk_offset(5) == geo.chunk_offset(1)
    assert geo.chunk_offset(4) == geo.chunk_offset(0)
    assert geo.chunk_offset(1) - geo.chunk_offset(0) == geo.chunk_stride
    assert geo.chunk_stride % layout.LINE == 0


@pytest.mark.parametrize("args,field", [((0, 1, 1024), "n_readers"), ((1, 0, 1024), "max_chunks"),
                                        ((1, 1, 10), "max_chunk_bytes")])
def test_bad_geometry_names_the_field(args: tuple[int, int, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RingLayout(*args)
