"""heap.release_free_pages: freed-but-kept heap pages go back to the OS."""

import sys

import pytest
import torch

from rlvr_lightning.device import heap


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_holes_in_the_heap_are_returned():
    # 2000 tensors of 64 KiB (below glibc's mmap threshold: served from the heap), every other
    # one freed: 62 MiB of holes that the heap keeps until they are trimmed
    blocks = [torch.ones(16384) for _ in range(2000)]
    del blocks[::2]
    before = _rss_mb()
    assert heap.release_free_pages()
    after = _rss_mb()
    assert before - after > 40, (before, after)
    assert all(float(b[0]) == 1.0 for b in blocks)  # the live half is untouched
