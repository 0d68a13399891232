"""Run ``turnout frontend`` under cProfile, timed in CPU time of the event-loop thread.

``python -m cProfile`` times functions in wall-clock time, so on a loaded machine a function
that was merely descheduled looks expensive, and an event loop waiting in ``epoll`` dominates.
This runner uses ``time.thread_time`` (CPU time of the calling thread): the Python work runs
on the main thread (the event loop, HTTP parsing included), so the profile shows where the
loop thread spends CPU.

Usage: ``python benchmarks/profile_frontend.py OUT.prof frontend --port ...`` (the arguments
after OUT.prof are the ``turnout`` command line). The profile is written when the frontend
exits (SIGINT).

The timer is a Python-level callable, which makes the profiled process several times slower:
compare shares within one profile, never absolute times with an unprofiled run.
"""

from __future__ import annotations

import cProfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    from turnout.cli.main import main as turnout_main

    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        return turnout_main(argv)
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    sys.exit(main())
