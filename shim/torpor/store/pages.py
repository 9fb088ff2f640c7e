"""Chunk boundaries for CRIU's page images by virtual address, so that host memory dedups.

CRIU writes a process's present pages back to back into pages-<id>.img, in the order of the
entries of its pagemap image (pagemap-<pid>.img: a head naming the pages id, then one entry
per run of pages: vaddr, nr_pages, flags). Cut into fixed-size pieces by offset, one page that
appears or goes away low in the address space (a heap that grew, a stack page touched) shifts
every byte after it, and none of the later chunks match the previous checkpoint's any more.

So a page image is cut by address instead: one piece per aligned window of `window` bytes of
virtual address space, holding the present pages of that window. A piece's content then depends
on that window alone: a change elsewhere never touches it, and an unchanged 10 GiB of weights
in host memory dedups whatever the rest of the program did. A piece holds at most `window`
bytes, so chunks stay within the store's size.

Any page image whose pagemap cannot be read, or whose entries do not add up to its size
exactly (a CRIU whose layout differs from the one described), gets no cuts: it is stored in
fixed-size pieces, dedups less, and is as correct.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any, Iterable

PE_PARENT = 1    # CRIU's pagemap flags (images/pagemap.proto): in the parent's images
PE_PRESENT = 4   # in this pages image


def _entries(path: Path) -> list[dict[str, Any]] | None:
    """The pagemap's head and entries, each entry with its page count in "nr_pages" whichever
    CRIU wrote it. CRIU 4.2 moved the count to a 64-bit field (5, "nr_pages") and left field 2
    ("compat_nr_pages") at 0; a pycriu older than the CRIU that wrote the image does not know
    field 5, so it is read from the message's unknown fields."""
    try:
        import pycriu  # noqa: PLC0415 (CRIU's own image decoder; absent: fixed chunks)
        from google.protobuf.unknown_fields import UnknownFieldSet  # noqa: PLC0415
        from pycriu.images import pb  # noqa: PLC0415
        with open(path, "rb") as f:
            entries = pycriu.images.load(f)["entries"]
            if all(e.get("nr_pages") or e.get("compat_nr_pages") for e in entries[1:]):
                for e in entries[1:]:
                    e["nr_pages"] = e.get("nr_pages") or e["compat_nr_pages"]
                return entries
            # an older pycriu: the same records again (after the two magics: a 4-byte length,
            # then the message), the count taken from field 5
            f.seek(8)
            for e in entries:
                size = int.from_bytes(f.read(4), "little")
                msg = (pb.pagemap_head if "pages_id" in e else pb.pagemap_entry)()
                msg.ParseFromString(f.read(size))
                wide = [u.data for u in UnknownFieldSet(msg) if u.field_number == 5]
                if wide:
                    e["nr_pages"] = wide[0]
            return entries
    except Exception:  # noqa: BLE001 (any undecodable pagemap: fall back, never fail a pack)
        return None


def window_pieces(entries: Iterable[dict[str, Any]], window: int, page: int) -> list[int]:
    """The lengths of the pieces of the pages image that entries (a pagemap's, head left out)
    describe: one per window of virtual address space that holds present pages."""
    pieces: list[int] = []
    current = None
    for e in entries:
        if not e["flags"] & PE_PRESENT or e["flags"] & PE_PARENT:
            continue
        va, left = e["vaddr"], e["nr_pages"] * page
        while left:
            w = va // window
            take = min(left, (w + 1) * window - va)
            if w == current:
                pieces[-1] += take
            else:
                pieces.append(take)
                current = w
            va += take
            left -= take
    return pieces


def page_image_pieces(images_dir: Path, window: int) -> dict[str, list[int]]:
    """{relative path of a pages image: its piece lengths} for the page images of a CRIU
    images directory whose pagemap describes them exactly."""
    page = resource.getpagesize()
    out: dict[str, list[int]] = {}
    for pagemap in sorted(images_dir.glob("pagemap-*.img")):
        entries = _entries(pagemap)
        if not entries or "pages_id" not in entries[0]:
            continue
        target = images_dir / f"pages-{entries[0]['pages_id']}.img"
        try:
            pieces = window_pieces(entries[1:], window, page)
            size = target.stat().st_size
        except (KeyError, TypeError, OSError):
            continue
        if pieces and sum(pieces) == size:
            out[target.name] = pieces
    return out
