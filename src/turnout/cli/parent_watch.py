"""A worker started by ``turnout serve`` dies with it, even when serve is killed outright.

``serve`` runs its workers in sessions of their own (a Ctrl-C meant for serve must not reach
them before serve decides), so nothing of the terminal or the process group ends them when
serve is SIGKILLed: they would go on serving, registered, under no supervisor. Two links,
set up by the child itself at start:

* **Linux**: ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends SIGTERM when the parent
  dies. It fires when the parent *thread* that forked the child ends, which is serve's event
  loop thread, the main one (asyncio forks from the loop thread), so only when serve ends.
* **Anywhere**: a pipe (``ParentPipe``) whose write end serve alone holds and never writes;
  the child gets the read end (``--parent-fd``) and a thread blocks reading it. The kernel
  closes serve's end when serve dies, whatever killed it, and the read returns EOF.

The pipe also closes the race of the first: a parent that died between the fork and the
``prctl`` sends no signal, but its end of the pipe is already closed, so the first read
returns EOF at once.

On EOF the child sends itself SIGTERM, the graceful path of every command
(``lifecycle.run_until_signal``): a worker revokes its lease, so its registrations vanish at
once rather than a lease TTL later, and drains. If that has not ended the process within
``grace`` seconds, it exits hard.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("turnout.cli")

#: ``<linux/prctl.h>``
PR_SET_PDEATHSIG = 1
#: Exit status of a child that outlived its parent by more than its grace.
ORPHAN_EXIT_STATUS = 3


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only);
    whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class ParentPipe:
    """The parent's end of the link: a pipe whose write end only this process holds.

    Both ends are non-inheritable (``os.pipe``): a child gets the read end only through
    ``pass_fds``, and no child ever holds the write end, which would keep the pipe open
    after the parent died.
    """

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()

    def close(self) -> None:
        for fd in (self.read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def watch_parent(fd: int, grace: float) -> None:
    """In the child: die with the parent whose pipe end ``fd`` reads (see the module
    docstring); gracefully (SIGTERM to itself), then, past ``grace`` seconds, hard."""
    set_parent_death_signal(signal.SIGTERM)
    try:
        os.set_inheritable(fd, False)  # the worker's own children must not keep it open
    except OSError as exc:
        from turnout.errors import ConfigError

        raise ConfigError(f"--parent-fd {fd}: {exc.strerror}") from None
    thread = threading.Thread(
        target=_wait_for_eof, args=(fd, grace), name="parent-watch", daemon=True
    )
    thread.start()


def _wait_for_eof(fd: int, grace: float) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    log.warning("the parent process (turnout serve) is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)
    # A daemon thread: a graceful stop ends the process, and this wait with it.
    threading.Event().wait(grace)
    # No logging.shutdown(): the main thread, stuck, may hold a handler's lock. A stream
    # handler flushes every record anyway.
    log.error("still running %gs after the parent died; exiting now", grace)
    os._exit(ORPHAN_EXIT_STATUS)
