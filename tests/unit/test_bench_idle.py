"""``epd bench idle``'s attribution of CPU to thread names, on this very process."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest

from epd_bench.idle import busiest_threads, threads_cpu_s

pytestmark = pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs Linux /proc"
)


def _burn_as(name: str, seconds: float, done: threading.Event) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc shows as the thread's name
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    done.wait()


def test_a_busy_thread_is_named_with_its_cpu():
    before = threads_cpu_s([os.getpid()])
    done = threading.Event()
    burner = threading.Thread(target=_burn_as, args=("epd-burner", 0.3, done))
    start = time.monotonic()
    burner.start()
    try:
        while "epd-burner" not in threads_cpu_s([os.getpid()]) or (
            threads_cpu_s([os.getpid()])["epd-burner"][1] < 0.2
        ):
            assert time.monotonic() - start < 30, "the burner never showed its CPU"
            time.sleep(0.05)
        after = threads_cpu_s([os.getpid()])
    finally:
        done.set()
        burner.join()
    wall = time.monotonic() - start
    assert after["epd-burner"][0] == 1
    rows = busiest_threads(before, after, wall)
    assert rows[0]["thread"] == "epd-burner", rows[:3]
    assert rows[0]["cores"] >= 0.2 / wall
