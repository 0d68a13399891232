"""``FileStore``: the discovery store shared by the processes of one machine, in one SQLite file.

Mental model: the database *is* the store; no process owns it. Every process that opens the
file is a peer, and every one of them keeps the store honest:

* ``kv(key, value, lease_id, mod_revision)`` holds the keys; ``leases(id, ttl, expires_at)``
  the leases, with a deadline that ``keep_alive`` pushes forward.
* ``events(revision, kind, key, value, lease_id)`` is an append-only log of every change;
  ``meta`` holds the current revision and the compaction point (the log holds every change
  after it). A watcher remembers the last revision it yielded and polls the log for newer rows,
  which makes watches resumable across processes.
* Expired leases are swept by whoever looks first: every read and every watcher poll deletes
  the keys of leases whose deadline has passed (logging DELETE events) in one write
  transaction. A ``kill -9``'d process therefore vanishes for everyone within TTL plus one poll
  interval, with nobody in charge.
* The log is trimmed to the last ``HISTORY_LIMIT`` changes (or by ``compact``); a watcher that
  resumes from before the trimmed point is resynced instead: PUTs of the keys whose
  ``mod_revision`` is newer, and DELETEs from ``tombstones(key, revision)``, which keeps the
  revision of every deleted key's last deletion (a key put again loses its tombstone). So
  it learns what vanished while it was away, never keeping a ghost.
* Tombstones are bounded (the base contract): at each trim of the log, those older than
  ``DELETE_GRACE_SECONDS`` that every open watch, in any process, is past are dropped. Open
  watches are rows of ``watchers(id, pid, position)``: written when a watch starts, its
  position moved forward at most every ``_POSITION_EVERY`` seconds (a stale position only
  keeps more), removed when it ends or its store closes; the rows of a process that is gone
  (``kill -9``: its pid is no longer alive on this machine, or it ran in another boot) are
  removed by the next trim (a process in another pid namespace may read as gone: its row is
  written again at its next position update, and the grace covers it meanwhile).

The database runs in WAL mode (readers never block the writer) with a busy timeout, so any
number of processes may open the same path at once. Each store object talks to SQLite through
one dedicated thread: calls are short, and the event loop never blocks on the file.

**Clock.** Deadlines are in ``CLOCK_MONOTONIC`` seconds, never the wall clock: an NTP step (or
an operator setting the date) would otherwise expire, or prolong, every lease at once. On Linux
(and macOS) that clock is system-wide, counted from boot, and the same in every process, so
deadlines written by one process mean the same in all of them; it never jumps (``adjtime``
slews it), and it stops during suspend, as every process does. What it does not survive is a
reboot: the file keeps the boot id (``/proc/sys/kernel/random/boot_id``) its deadlines belong
to, and the first process of a new boot to open it ends every lease of the old one (its keys
vanish, with DELETE events). As a second guard, a deadline further ahead than its lease's TTL
cannot come from this clock (a writer on the wall clock, or in another time namespace): such
a lease is ended by the next sweep. Processes in containers share the host's clock unless
they run in their own time namespace, which is not supported.

**A file deleted or replaced under running processes.** SQLite keeps using the inode it
opened: processes that had the file open go on sharing the unlinked one, while every process
started later creates a new, empty store at the path, and the deployment is split in two
without a word. Every poll interval (on calls and watch polls) the store compares the path's
device and inode with the ones it opened; when they differ it logs one error and from then on
every call fails with a ``DiscoveryError`` naming the path, so leases are lost, watches fail
and retry, and the operator sees it. It does not re-open the new file by itself: revisions
start again in a new file, and a watcher resuming from a revision of the old one would miss
every change until the new file caught up, which is the silent split again. Restart the
processes of the deployment.

**A process stopped inside a write transaction** (SIGSTOP, a debugger, a swapped-out VM)
holds SQLite's one write lock: readers go on (WAL), but no keep-alive can be written, and
when the lock comes back every lease looks past its deadline and the first sweep would end
them all, for a fault of one process. So the store's time is taken to stand still while
nobody can write, as etcd refreshes every lease when it elects a new leader: each write
transaction records when it started; a writer that had to wait for the lock (at least
``_STALL_MIN``) gives every lease alive when the stall began the stalled time back, from the
start of the transaction that held the lock (or its own first refused attempt, if earlier),
once per stall (``extended_until``). A writer waits ``_BUSY_TIMEOUT_MS`` at a time and is
retried, freeing the store's thread between attempts, for up to ``_BUSY_TOTAL`` seconds; a
sweep does not wait (the next poll sweeps). The price: a process that died holding the lock
(SQLite releases it; its transaction is rolled back) leaves the leases of the others a little
longer, by the time since the last committed transaction began.

**Trust.** Whoever can write the file can register workers that frontends send prompts to:
the folder is made ``0700`` and the file ``0600`` (with its ``-wal`` and ``-shm``), and a
folder of another user, or one others may write in, is refused (``file_path``).

**Polling.** A watch poll first asks ``PRAGMA data_version``, which changes when another
connection commits; with no commit from anyone (this connection's own are counted apart)
since the last poll that read the log, there is nothing new and the log is not read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import TypeVar

from turnout.errors import DiscoveryError
from turnout.runtime.discovery.base import (
    DELETE_GRACE_SECONDS,
    DiscoveryStore,
    KeyValue,
    WatchEvent,
    WatchEventKind,
)
from turnout.runtime.discovery.file_path import private_file, secure_folder

#: How many past changes the events log keeps for resuming watchers.
HISTORY_LIMIT = 10_000
#: Trim the log (and prune tombstones) every this many revisions (cheap, amortised).
_TRIM_EVERY = 500
#: A watch writes its position at most this often (seconds; only when it moved).
_POSITION_EVERY = 5.0
#: How long one attempt waits for the write lock; busy attempts are retried up to
#: ``_BUSY_TOTAL`` seconds in all, other calls of the store running in between.
_BUSY_TIMEOUT_MS = 1_000
_BUSY_TOTAL = 10.0
#: A sweep waits this little for the lock: it is retried at the next poll anyway.
_SWEEP_BUSY_MS = 50
#: A wait for the write lock this long is a stall: leases get the stalled time back.
_STALL_MIN = 0.25
#: Refused attempts closer together than this are one continuous wait.
_BUSY_CONTINUITY = 5.0
_PUT, _DELETE = 0, 1
#: A lease whose deadline is further ahead than its TTL plus this was not written with this
#: clock (see the module docstring) and is ended.
_CLOCK_SLACK = 1.0
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

logger = logging.getLogger("turnout.runtime")

_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL,
    lease_id INTEGER,
    mod_revision INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS kv_lease ON kv(lease_id) WHERE lease_id IS NOT NULL;
CREATE TABLE IF NOT EXISTS leases (
    id INTEGER PRIMARY KEY,
    ttl REAL NOT NULL,
    expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_expiry ON leases(expires_at);
CREATE TABLE IF NOT EXISTS events (
    revision INTEGER PRIMARY KEY,
    kind INTEGER NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    lease_id INTEGER
);
CREATE TABLE IF NOT EXISTS tombstones (
    key TEXT PRIMARY KEY,
    revision INTEGER NOT NULL,
    deleted_at REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS watchers (
    id INTEGER PRIMARY KEY,
    pid INTEGER NOT NULL,
    position INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('revision', 0), ('compacted', 0);
INSERT OR IGNORE INTO meta VALUES ('txn_started', 0), ('extended_until', 0);
CREATE TABLE IF NOT EXISTS clock (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def monotonic_clock() -> float:
    """``CLOCK_MONOTONIC`` in seconds: system-wide, the same in every process of the machine
    (see the module docstring)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def boot_id() -> str:
    """This boot's id (Linux), or ``""`` where there is none to read (then a file that
    outlives a reboot relies on the deadline guard alone: its leases end within one TTL)."""
    try:
        with open(_BOOT_ID_PATH) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (a reused pid reads as alive: that only
    keeps tombstones longer)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY: another connection holds the lock this one waited for."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) == sqlite3.SQLITE_BUSY
    return "locked" in str(exc) or "busy" in str(exc)


def _prefix_end(prefix: str) -> str | None:
    """The smallest string greater than every string starting with ``prefix`` (None: no bound).

    Keys compare as TEXT in SQLite (memcmp of UTF-8, which orders like code points), so
    ``prefix <= key < end`` selects the prefix with the primary-key index.
    """
    chars = list(prefix)
    while chars:
        last = ord(chars.pop())
        if last < 0x10FFFF:
            return "".join(chars) + chr(last + 1)
    return None


class FileStore(DiscoveryStore):
    """Discovery store in a SQLite file; see the module docstring for the design."""

    kind = "file"

    def __init__(
        self,
        path: str | os.PathLike[str],
        poll_interval: float = 0.05,
        *,
        clock: Callable[[], float] = monotonic_clock,
        boot: str | None = None,
        delete_grace: float = DELETE_GRACE_SECONDS,
    ) -> None:
        """``clock`` and ``boot`` (this boot's id) are for tests: every process sharing the
        file must agree on both, which the defaults do. ``delete_grace``: how long tombstones
        are kept at least (see the module docstring)."""
        self.path = os.fspath(path)
        self.poll_interval = poll_interval
        self._clock = clock
        self._delete_grace = delete_grace
        #: Rows of ``watchers`` this store's open watches own (removed on ``close``).
        self._watch_rows: set[int] = set()
        self._boot_id = boot_id() if boot is None else boot
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="turnout-filestore"
        )
        self._db: sqlite3.Connection | None = None
        self._closed = False
        # Thread-side state from here on.
        #: Clock time of the last sweep of expired leases.
        self._last_sweep = -float("inf")
        #: (st_dev, st_ino) of the file opened; the error once the path names another file.
        self._identity: tuple[int, int] | None = None
        self._ghost: str | None = None
        self._last_identity_check = -float("inf")
        #: Commits by this connection (``data_version`` does not count them), and what the
        #: last read of the log saw: (data_version, own commits, store revision).
        self._writes = 0
        self._seen: tuple[int, int, int] | None = None
        #: How often a watch poll read the log (tests check the polls that had nothing to do).
        self.log_reads = 0
        #: When this process's write attempts started being refused (busy), and the last one.
        self._busy_since: float | None = None
        self._busy_last = -float("inf")

    # -- plumbing -------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., _T], *args: object) -> _T:
        if self._closed:
            raise DiscoveryError(f"file store {self.path} is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _BUSY_TOTAL
        while True:
            try:
                return await loop.run_in_executor(self._executor, self._checked, fn, *args)
            except sqlite3.OperationalError as exc:
                # Another process holds the write lock: try again, letting this store's
                # other calls (reads never wait for the lock) run in between.
                if _is_busy(exc) and loop.time() < deadline and not self._closed:
                    continue
                raise DiscoveryError(f"file store {self.path}: {exc}") from exc
            except sqlite3.Error as exc:
                raise DiscoveryError(f"file store {self.path}: {exc}") from exc

    def _checked(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run ``fn`` unless the path no longer names the file this store opened."""
        self._check_identity()
        return fn(*args)

    def _check_identity(self) -> None:
        """Compare the path's device and inode with the open file's, once a poll interval;
        a mismatch (deleted, replaced) is logged once and fails every call from then on."""
        if self._ghost is None and self._identity is not None:
            now = time.monotonic()
            if now - self._last_identity_check >= self.poll_interval:
                self._last_identity_check = now
                try:
                    st = os.stat(self.path)
                    found = f"inode {st.st_ino} on device {st.st_dev}"
                    same = (st.st_dev, st.st_ino) == self._identity
                except FileNotFoundError:
                    found, same = "nothing", False
                if not same:
                    dev, ino = self._identity
                    self._ghost = (
                        f"file store {self.path} was deleted or replaced: this process opened "
                        f"inode {ino} on device {dev}, the path now names {found}; processes "
                        "started from now on would not see this one (a split deployment). "
                        "Restart the processes that share it"
                    )
                    logger.error("%s", self._ghost)
        if self._ghost is not None:
            raise DiscoveryError(self._ghost)

    def _conn(self) -> sqlite3.Connection:
        """The connection, opened on first use (in the store's thread)."""
        if self._db is None:
            secure_folder(os.path.dirname(os.path.abspath(self.path)))
            private_file(self.path)
            db = sqlite3.connect(
                self.path,
                timeout=_BUSY_TIMEOUT_MS / 1000,
                isolation_level=None,
                check_same_thread=False,
            )
            db.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                columns = {row[1] for row in db.execute("PRAGMA table_info(tombstones)")}
                if "deleted_at" not in columns:  # a file whose tombstones carry no deletion time
                    db.execute(
                        "ALTER TABLE tombstones ADD COLUMN deleted_at REAL NOT NULL DEFAULT 0"
                    )
                self._adopt_boot(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                db.close()
                raise
            # The file is open (SQLite holds its descriptor): remember which one it is.
            st = os.stat(self.path)
            self._identity = (st.st_dev, st.st_ino)
            self._db = db
        return self._db

    def _adopt_boot(self, db: sqlite3.Connection) -> None:
        """Deadlines of another boot (or of a file with no boot id, whose clock is unknown)
        mean nothing on this clock: end those leases, then claim the file for this boot."""
        row = db.execute("SELECT value FROM clock WHERE name='boot_id'").fetchone()
        if row is not None and row[0] == self._boot_id:
            return
        db.execute("UPDATE meta SET value=0 WHERE name IN ('txn_started', 'extended_until')")
        ids = [lease_id for (lease_id,) in db.execute("SELECT id FROM leases").fetchall()]
        if ids:
            logger.warning(
                "file store %s: ending %d lease(s) from another boot (their deadlines are on "
                "that boot's clock)",
                self.path,
                len(ids),
            )
        self._end_leases(db, ids)
        # That boot's watches are gone, and its deletion times are on its clock: old.
        db.execute("DELETE FROM watchers")
        db.execute("UPDATE tombstones SET deleted_at=0")
        db.execute("INSERT OR REPLACE INTO clock VALUES ('boot_id', ?)", (self._boot_id,))

    def _write(
        self,
        fn: Callable[[sqlite3.Connection], _T],
        busy_ms: int = _BUSY_TIMEOUT_MS,
        *,
        stall_evidence: bool = True,
    ) -> _T:
        """Run ``fn`` in one IMMEDIATE (write-locked) transaction, waiting up to ``busy_ms``
        for the lock (then ``sqlite3.OperationalError``, "database is locked"). A refusal
        counts as evidence of a stall (see ``_begin``) unless ``stall_evidence`` is False."""
        db = self._conn()
        if busy_ms != _BUSY_TIMEOUT_MS:
            db.execute(f"PRAGMA busy_timeout={busy_ms}")
        asked = self._clock()
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if _is_busy(exc) and stall_evidence:
                if self._busy_since is None or asked - self._busy_last > _BUSY_CONTINUITY:
                    self._busy_since = asked
                self._busy_last = self._clock()
            raise
        finally:
            if busy_ms != _BUSY_TIMEOUT_MS:
                db.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        try:
            self._begin(db, asked)
            result = fn(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        self._writes += 1
        return result

    def _read(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn`` in one read transaction (a consistent snapshot under WAL)."""
        db = self._conn()
        db.execute("BEGIN")
        try:
            return fn(db)
        finally:
            db.execute("COMMIT")

    def _begin(self, db: sqlite3.Connection, asked: float) -> None:
        """First step of every write transaction: give leases back the time the store was
        write-locked, if this writer waited for it (see the module docstring), and record
        when this transaction started."""
        now = self._clock()
        since = asked
        if self._busy_since is not None and asked - self._busy_last <= _BUSY_CONTINUITY:
            since = min(since, self._busy_since)
        self._busy_since = None
        if now - since >= _STALL_MIN:
            (held_from,) = db.execute("SELECT value FROM meta WHERE name='txn_started'").fetchone()
            (extended,) = db.execute(
                "SELECT value FROM meta WHERE name='extended_until'"
            ).fetchone()
            start = max(float(extended), min(float(held_from), since))
            stalled = now - start
            if stalled >= _STALL_MIN:
                # Never past a full TTL from now: a deadline further out than that reads as
                # "not written with this clock", and the sweep would end a healthy lease.
                cur = db.execute(
                    "UPDATE leases SET expires_at = MIN(expires_at + ?, ? + ttl) "
                    "WHERE expires_at >= ?",
                    (stalled, now, start),
                )
                db.execute("UPDATE meta SET value=? WHERE name='extended_until'", (now,))
                logger.warning(
                    "file store %s was write-locked for %.1fs (a process stopped or hung inside "
                    "a transaction?); %d lease(s) given that time back",
                    self.path,
                    stalled,
                    cur.rowcount,
                )
        db.execute("UPDATE meta SET value=? WHERE name='txn_started'", (now,))

    @staticmethod
    def _next_revision(db: sqlite3.Connection) -> int:
        (rev,) = db.execute("SELECT value FROM meta WHERE name='revision'").fetchone()
        return int(rev) + 1

    def _log(
        self,
        db: sqlite3.Connection,
        rev: int,
        kind: int,
        key: str,
        value: bytes,
        lease_id: int | None,
    ) -> None:
        db.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?)", (rev, kind, key, value, lease_id))
        db.execute("UPDATE meta SET value=? WHERE name='revision'", (rev,))
        if rev % _TRIM_EVERY == 0:
            if rev > HISTORY_LIMIT:
                cut = rev - HISTORY_LIMIT
                db.execute("DELETE FROM events WHERE revision <= ?", (cut,))
                db.execute("UPDATE meta SET value=? WHERE name='compacted'", (cut,))
            self._prune_tombstones(db)

    def _prune_tombstones(self, db: sqlite3.Connection) -> None:
        """Drop the tombstones no resuming watcher can need any more: older than the grace
        and passed by every open watch (all such when none is open). Rows of watches whose
        process is gone go first."""
        rows = db.execute("SELECT id, pid FROM watchers").fetchall()
        gone = [(row_id,) for row_id, pid in rows if not _pid_alive(pid)]
        db.executemany("DELETE FROM watchers WHERE id=?", gone)
        (lowest,) = db.execute("SELECT min(position) FROM watchers").fetchone()
        horizon = self._clock() - self._delete_grace
        if lowest is None:
            db.execute("DELETE FROM tombstones WHERE deleted_at < ?", (horizon,))
        else:
            db.execute(
                "DELETE FROM tombstones WHERE deleted_at < ? AND revision <= ?",
                (horizon, lowest),
            )

    def _delete_keys(self, db: sqlite3.Connection, keys: list[tuple[str, int | None]]) -> None:
        for key, lease_id in keys:
            rev = self._next_revision(db)
            db.execute("DELETE FROM kv WHERE key=?", (key,))
            db.execute(
                "INSERT OR REPLACE INTO tombstones VALUES (?, ?, ?)", (key, rev, self._clock())
            )
            self._log(db, rev, _DELETE, key, b"", lease_id)

    def _end_leases(self, db: sqlite3.Connection, lease_ids: list[int]) -> None:
        for lease_id in lease_ids:
            rows = db.execute(
                "SELECT key FROM kv WHERE lease_id=? ORDER BY key", (lease_id,)
            ).fetchall()
            self._delete_keys(db, [(key, lease_id) for (key,) in rows])
            db.execute("DELETE FROM leases WHERE id=?", (lease_id,))

    #: Leases past their deadline, or with a deadline no process on this clock could have
    #: written (further ahead than their TTL): parameters (now, now, slack).
    _EXPIRED = "FROM leases WHERE expires_at < ? OR expires_at > ? + ttl + ?"

    def _sweep(self, force: bool = False) -> None:
        """End every lease past its deadline. Cheap when nothing expired (one read of the
        small leases table); rate-limited to once a poll interval unless ``force``."""
        now = self._clock()
        if not force and now - self._last_sweep < self.poll_interval:
            return
        self._last_sweep = now
        db = self._conn()
        params = (now, now, _CLOCK_SLACK)
        if db.execute(f"SELECT 1 {self._EXPIRED} LIMIT 1", params).fetchone():

            def sweep(db: sqlite3.Connection) -> None:
                # Now, not when the read above ran: the lock may have been waited for.
                now = self._clock()
                expired = db.execute(f"SELECT id {self._EXPIRED}", (now, now, _CLOCK_SLACK))
                self._end_leases(db, [lease_id for (lease_id,) in expired.fetchall()])

            try:
                # A sweep gives up after a short wait by design: that is no stall, and must
                # not make this process's next write give every lease time back.
                self._write(sweep, busy_ms=_SWEEP_BUSY_MS, stall_evidence=False)
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                self._last_sweep = -float("inf")  # someone holds the lock: next poll

    # -- leases ---------------------------------------------------------------------------

    async def grant_lease(self, ttl: float) -> int:
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")

        def grant(db: sqlite3.Connection) -> int:
            while True:
                lease_id = secrets.randbits(63) or 1
                cur = db.execute(
                    "INSERT OR IGNORE INTO leases VALUES (?, ?, ?)",
                    (lease_id, ttl, self._clock() + ttl),
                )
                if cur.rowcount == 1:
                    return lease_id

        return await self._call(self._write, grant)

    async def keep_alive(self, lease_id: int) -> bool:
        def keep(db: sqlite3.Connection) -> bool:
            now = self._clock()
            cur = db.execute(
                "UPDATE leases SET expires_at = ? + ttl WHERE id = ? AND expires_at >= ?",
                (now, lease_id, now),
            )
            return cur.rowcount == 1

        def run() -> bool:
            alive = self._write(keep)
            if not alive:
                self._sweep(force=True)
            return alive

        return await self._call(run)

    async def revoke_lease(self, lease_id: int) -> None:
        await self._call(self._write, lambda db: self._end_leases(db, [lease_id]))

    # -- keys -----------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease_id: int | None = None) -> int:
        value = bytes(value)

        def put(db: sqlite3.Connection) -> int:
            if lease_id is not None:
                row = db.execute(
                    "SELECT 1 FROM leases WHERE id=? AND expires_at >= ?", (lease_id, self._clock())
                ).fetchone()
                if row is None:
                    raise DiscoveryError(f"cannot put {key!r}: lease {lease_id:x} does not exist")
            rev = self._next_revision(db)
            db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?, ?, ?)", (key, value, lease_id, rev))
            db.execute("DELETE FROM tombstones WHERE key=?", (key,))
            self._log(db, rev, _PUT, key, value, lease_id)
            return rev

        return await self._call(self._write, put)

    async def get(self, key: str) -> KeyValue | None:
        def get() -> KeyValue | None:
            self._sweep()
            row = (
                self._conn()
                .execute("SELECT key, value, mod_revision, lease_id FROM kv WHERE key=?", (key,))
                .fetchone()
            )
            return KeyValue(*row) if row else None

        return await self._call(get)

    def _select_prefix(self, db: sqlite3.Connection, prefix: str) -> list[KeyValue]:
        end = _prefix_end(prefix)
        sql = "SELECT key, value, mod_revision, lease_id FROM kv WHERE key >= ?"
        params: tuple[str, ...] = (prefix,)
        if end is not None:
            sql += " AND key < ?"
            params = (prefix, end)
        rows = db.execute(sql + " ORDER BY key", params).fetchall()
        return [KeyValue(*row) for row in rows]

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        def get_prefix() -> list[KeyValue]:
            self._sweep()
            return self._read(lambda db: self._select_prefix(db, prefix))

        return await self._call(get_prefix)

    async def delete(self, key: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT lease_id FROM kv WHERE key=?", (key,)).fetchone()
            if row is None:
                return False
            self._delete_keys(db, [(key, row[0])])
            return True

        return await self._call(self._write, delete)

    # -- watches --------------------------------------------------------------------------

    def _snapshot(self, prefix: str) -> tuple[list[KeyValue], int]:
        self._sweep()

        def snap(db: sqlite3.Connection) -> tuple[list[KeyValue], int]:
            (rev,) = db.execute("SELECT value FROM meta WHERE name='revision'").fetchone()
            return self._select_prefix(db, prefix), int(rev)

        return self._read(snap)

    @staticmethod
    def _resync(db: sqlite3.Connection, prefix: str, after: int) -> list[WatchEvent]:
        """What changed under ``prefix`` since ``after`` when the log no longer reaches back:
        PUTs of newer keys, DELETEs of newer tombstones, in revision order."""
        end = _prefix_end(prefix)
        bound = "" if end is None else " AND key < ?"
        params: tuple[object, ...] = (after, prefix) if end is None else (after, prefix, end)
        puts = db.execute(
            "SELECT key, value, mod_revision, lease_id FROM kv"
            " WHERE mod_revision > ? AND key >= ?" + bound,
            params,
        ).fetchall()
        deletes = db.execute(
            "SELECT key, revision FROM tombstones WHERE revision > ? AND key >= ?" + bound,
            params,
        ).fetchall()
        events = [WatchEvent(WatchEventKind.PUT, KeyValue(*row)) for row in puts]
        events += [
            WatchEvent(WatchEventKind.DELETE, KeyValue(key=key, value=b"", revision=rev))
            for key, rev in deletes
        ]
        events.sort(key=lambda ev: ev.kv.revision)
        return events

    def _changes(self, prefix: str, after: int) -> tuple[list[WatchEvent], int]:
        """Changes under ``prefix`` after revision ``after`` and the store revision they reach
        (a resync when the log was trimmed past ``after``)."""
        self._sweep()
        db = self._conn()
        (version,) = db.execute("PRAGMA data_version").fetchone()
        seen = self._seen
        if seen is not None and seen[:2] == (version, self._writes) and after >= seen[2]:
            return [], after  # nobody committed since the last read of the log
        self.log_reads += 1

        def changes(db: sqlite3.Connection) -> tuple[list[WatchEvent], int]:
            (compacted,) = db.execute("SELECT value FROM meta WHERE name='compacted'").fetchone()
            (rev,) = db.execute("SELECT value FROM meta WHERE name='revision'").fetchone()
            self._seen = (version, self._writes, int(rev))
            if after < compacted:
                return self._resync(db, prefix, after), int(rev)
            if rev <= after:
                return [], after
            end = _prefix_end(prefix)
            sql = (
                "SELECT revision, kind, key, value, lease_id FROM events"
                " WHERE revision > ? AND revision <= ? AND key >= ?"
            )
            params: tuple[object, ...] = (after, rev, prefix)
            if end is not None:
                sql += " AND key < ?"
                params = (*params, end)
            rows = db.execute(sql + " ORDER BY revision", params).fetchall()
            events = [
                WatchEvent(
                    WatchEventKind.PUT if kind == _PUT else WatchEventKind.DELETE,
                    KeyValue(key=key, value=value, revision=r, lease_id=lease_id),
                )
                for r, kind, key, value, lease_id in rows
            ]
            return events, int(rev)

        return self._read(changes)

    async def watch_prefix(
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        after = start_revision
        #: This watch's row in ``watchers``, the position it holds, and when it was written.
        row: int | None = None
        written = -1
        written_at = -float("inf")
        try:
            while not self._closed:
                try:
                    if after is not None and (
                        row is None
                        or (after > written and self._clock() - written_at >= _POSITION_EVERY)
                    ):
                        # Every event up to ``after`` was handed over: resuming from there
                        # needs no tombstone at or below it.
                        row = await self._call(
                            self._write, partial(self._place_watcher, row, after)
                        )
                        written, written_at = after, self._clock()
                    if after is None:
                        kvs, after = await self._call(self._snapshot, prefix)
                        events = [WatchEvent(WatchEventKind.PUT, kv) for kv in kvs]
                    else:
                        events, after = await self._call(self._changes, prefix, after)
                except DiscoveryError:
                    if self._closed:
                        return
                    raise
                for event in events:
                    yield event
                await asyncio.sleep(self.poll_interval)
        finally:
            if row is not None and not self._closed:
                self._watch_rows.discard(row)
                with contextlib.suppress(DiscoveryError):  # the file is gone: so is the row
                    await self._call(self._write, partial(self._remove_watchers, [row]))

    def _place_watcher(self, row: int | None, position: int, db: sqlite3.Connection) -> int:
        """Write a watch's position (a new row when ``row`` is None, or when its row was
        removed as a dead process's: a pid seen from another pid namespace); returns its row
        id."""
        if row is not None:
            cur = db.execute("UPDATE watchers SET position=? WHERE id=?", (position, row))
            if cur.rowcount == 1:
                return row
            self._watch_rows.discard(row)
        cur = db.execute(
            "INSERT INTO watchers (pid, position) VALUES (?, ?)", (os.getpid(), position)
        )
        assert cur.lastrowid is not None
        self._watch_rows.add(cur.lastrowid)
        return cur.lastrowid

    @staticmethod
    def _remove_watchers(rows: list[int], db: sqlite3.Connection) -> None:
        db.executemany("DELETE FROM watchers WHERE id=?", [(row,) for row in rows])

    async def compact(self, revision: int) -> None:
        """Drop the log up to ``revision``; watchers resuming before it resync."""

        def compact(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM events WHERE revision <= ?", (revision,))
            db.execute("UPDATE meta SET value=max(value, ?) WHERE name='compacted'", (revision,))

        await self._call(self._write, compact)

    async def open(self) -> None:
        """Open the file now rather than on first use: its folder is made or checked and the
        file made private (``file_path``), so a store that is not this user's alone is a
        ``ConfigError`` at start, not at the first registration."""
        await self._call(self._conn)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        def shut() -> None:
            if self._db is not None:
                if self._watch_rows and self._ghost is None:
                    with contextlib.suppress(sqlite3.Error):  # rows of a live pid: kept
                        self._write(partial(self._remove_watchers, sorted(self._watch_rows)))
                    self._watch_rows.clear()
                self._db.close()
                self._db = None

        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, shut)
        self._executor.shutdown(wait=True)
