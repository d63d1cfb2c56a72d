"""A process that keeps its freed memory (services/memory.py) mostly reuses a fragment-sized
buffer's pages where without it every sync faults them in again: in a fresh interpreter, a 96 MB
tensor allocated, filled and freed on a new thread again and again, as a sync thread does with a
pulled fragment."""
import os
import pathlib
import subprocess
import sys

import pytest

from diloco.services.memory import GLIBC_TUNABLES

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUFFER_PAGES = (96 << 20) // 4096
SYNCS = 8
LOOP = """
import resource, sys, threading
import torch
def sync():
    torch.empty(24 << 20).fill_(1.0)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for warm_up in range(2):
    thread = threading.Thread(target=sync); thread.start(); thread.join()
before = faults()
for _ in range(SYNCS):
    thread = threading.Thread(target=sync); thread.start(); thread.join()
print(faults() - before)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")


def page_faults_of_syncs(prelude: str = "", env: dict | None = None) -> int:
    result = subprocess.run([sys.executable, "-c", prelude + LOOP.replace("SYNCS", str(SYNCS))], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**os.environ, **(env or {})}, check=True)
    return int(result.stdout.split()[-1])


def test_without_it_every_sync_faults_its_buffer_in_again():
    assert page_faults_of_syncs() > (SYNCS - 1) * BUFFER_PAGES


# Kept, most syncs reuse the memory the last one freed; some still grow the heap a little (torch
# asks for 64-byte aligned blocks, which a freed block of the same size does not always fit).
def test_keep_freed_memory_faults_most_syncs_buffers_in_not_at_all():
    kept = page_faults_of_syncs("from diloco.services.memory import keep_freed_memory; keep_freed_memory()\n")
    assert kept < SYNCS // 2 * BUFFER_PAGES


def test_the_tunables_the_docs_give_do_the_same_without_code():
    assert GLIBC_TUNABLES in (ROOT / "docs" / "gpus.md").read_text()
    assert page_faults_of_syncs(env={"GLIBC_TUNABLES": GLIBC_TUNABLES}) < SYNCS // 2 * BUFFER_PAGES
