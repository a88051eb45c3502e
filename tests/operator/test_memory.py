"""The operator's RSS comes back down after a burst (adapters/memory.py): freed objects'
pages go back to the kernel once trimmed, instead of staying at the high-water mark."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import sys
    from tpufinetune.adapters import memory

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    assert memory.bound_arenas()
    held = [bytes(2048) + bytes([i % 251]) for i in range(60_000)]  # ~120 MB in malloc'd blocks
    keep = held[::1000]  # a few survive, scattered, as a burst leaves some objects alive
    del held
    before = rss_mb()
    released = memory.trim()
    after = rss_mb()
    print(f"{before:.0f} {after:.0f} {int(released)}")
""")


def test_a_trim_hands_a_bursts_freed_memory_back():
    # A fresh process: the test runner's own heap would blur the figures. Without the trim
    # (a gc.collect() alone) the same process stays at its high-water mark: checked.
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout.split()
    before, after, released = float(out[0]), float(out[1]), out[2]
    assert released == "1"
    assert before - after > 60, f"RSS {before:.0f} MB -> {after:.0f} MB after the trim"
