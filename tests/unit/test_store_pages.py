"""store/pages.py: CRIU page images cut by virtual-address window, so a page that appears low in
the address space does not change the chunks of the memory above it."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pycriu
import pytest

from torpor.errors import UsageError
from torpor.store import Store
from torpor.store.pages import PE_PARENT, PE_PRESENT, page_image_pieces, window_pieces

PAGE = resource.getpagesize()
WINDOW = 16 * PAGE
LAZY = 2


def entry(vaddr: int, pages: int, flags: int = PE_PRESENT) -> dict:
    return {"vaddr": vaddr, "nr_pages": pages, "flags": flags}


def test_one_piece_per_window_holding_present_pages():
    entries = [entry(0, 1), entry(3 * PAGE, 2, PE_PRESENT | LAZY),   # window 0: 3 pages
               entry(10 * PAGE, 20),                                 # 6 in window 0, 14 in 1
               entry(40 * PAGE, 4, PE_PARENT | PE_PRESENT),          # in the parent's images
               entry(50 * PAGE, 3, 0),                               # not present
               entry(100 * PAGE, 40)]                                # windows 6, 7, 8
    assert window_pieces(entries, WINDOW, PAGE) == [p * PAGE for p in (9, 14, 12, 16, 12)]


def _as_written(e: dict) -> dict:
    """An entry as this pycriu's CRIU writes it: CRIU >= 4.2 has the required 32-bit
    compat_nr_pages at 0 beside the 64-bit nr_pages (store/pages.py reads both)."""
    from pycriu.images import pagemap_pb2
    if "compat_nr_pages" in pagemap_pb2.pagemap_entry.DESCRIPTOR.fields_by_name:
        return {**e, "compat_nr_pages": 0}
    return e


def write_images(d: Path, entries: list[dict], pages_id: int = 3, extra: int = 0) -> bytes:
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "pagemap-42.img", "wb") as f:
        pycriu.images.dump({"magic": "PAGEMAP", "entries": [{"pages_id": pages_id},
                                                             *map(_as_written, entries)]}, f)
    n = sum(e["nr_pages"] for e in entries if e["flags"] & PE_PRESENT
            and not e["flags"] & PE_PARENT)
    data = os.urandom(n * PAGE + extra)
    (d / f"pages-{pages_id}.img").write_bytes(data)
    return data


def test_pieces_come_from_the_pagemap_of_a_real_image_pair(tmp_path):
    write_images(tmp_path, [entry(0x7000 * PAGE, 5), entry(0x7010 * PAGE + 0, 30)])
    assert page_image_pieces(tmp_path, WINDOW) == {"pages-3.img": [5 * PAGE, 16 * PAGE,
                                                                   14 * PAGE]}


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_a_criu_4_2_pagemap_is_read_whatever_pycriu_knows(tmp_path):
    """CRIU 4.2 writes the page count into a 64-bit field 5 and leaves field 2 at 0 (seen on
    the GPU host: CRIU 4.2.1 with a 4.1 pycriu gave every entry 0 pages, so no image was cut
    and a second checkpoint stored everything again)."""
    from pycriu.images import pb
    with open(tmp_path / "pagemap-42.img", "wb") as f:
        pycriu.images.dump({"magic": "PAGEMAP", "entries": [{"pages_id": 3}]}, f)
        for vaddr, pages in ((0x7000 * PAGE, 5), (0x7010 * PAGE, 30)):
            msg = pb.pagemap_entry(vaddr=vaddr, flags=PE_PRESENT)
            for field in msg.DESCRIPTOR.fields:
                if field.number == 2:      # required in both layouts, 0 in CRIU 4.2's
                    setattr(msg, field.name, 0)
            raw = msg.SerializeToString() + b"\x28" + varint(pages)     # field 5, varint
            f.write(len(raw).to_bytes(4, "little") + raw)
    (tmp_path / "pages-3.img").write_bytes(os.urandom(35 * PAGE))
    assert page_image_pieces(tmp_path, WINDOW) == {"pages-3.img": [5 * PAGE, 16 * PAGE,
                                                                   14 * PAGE]}


@pytest.mark.parametrize("damage", ["size", "pagemap", "no pages"])
def test_a_pagemap_that_does_not_describe_its_image_gives_no_cuts(tmp_path, damage):
    write_images(tmp_path, [entry(0, 20)], extra=PAGE if damage == "size" else 0)
    if damage == "pagemap":
        (tmp_path / "pagemap-42.img").write_bytes(b"\0" * 40)
    if damage == "no pages":
        (tmp_path / "pages-3.img").unlink()
    assert page_image_pieces(tmp_path, WINDOW) == {}


def test_a_page_added_low_keeps_every_chunk_above_it(tmp_path):
    store = Store(tmp_path / "store", chunk_size=WINDOW, workers=2, lock_timeout=5)
    high = [entry(0x1000 * PAGE, 64)]                        # 4 windows of unchanged memory
    first = write_images(tmp_path / "one", [entry(0, 3)] + high)
    second = tmp_path / "two"
    write_images(second, [entry(0, 4)] + high)               # one page more below it
    pages = second / "pages-3.img"
    pages.write_bytes(os.urandom(4 * PAGE) + first[3 * PAGE:])
    for name, d in (("one", tmp_path / "one"), ("two", second)):
        _, stats = store.ingest_dir(d, name, pieces=page_image_pieces(d, WINDOW))
    assert stats.reused_chunks == 4 and stats.new_chunks == 2   # the low page's chunk, pagemap
    assert b"".join(store.read_file("two", "pages-3.img")) == pages.read_bytes()
    # cut by offset instead, the shifted memory matches nothing
    _, fixed = store.ingest_dir(second, "fixed")
    assert fixed.reused_chunks <= 1


def test_pieces_larger_than_a_chunk_are_refused(tmp_path):
    store = Store(tmp_path / "store", chunk_size=WINDOW, workers=1, lock_timeout=5)
    (tmp_path / "f").write_bytes(b"x" * (2 * WINDOW))
    with store.writer() as w, pytest.raises(UsageError, match="pieces of f"):
        w.add_file("f", tmp_path / "f", [2 * WINDOW])
