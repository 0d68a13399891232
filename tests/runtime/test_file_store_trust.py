"""The file store is trusted only when it is this user's alone: its folder is made 0700, its
files 0600 (the database, ``-wal`` and ``-shm``), and a folder of another user, or one others
may write in, is refused with one line; ``$XDG_RUNTIME_DIR`` is preferred for the default."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from turnout.errors import ConfigError
from turnout.runtime.discovery import default_file_store_path, open_store

NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(autouse=True)
def _umask() -> Iterator[None]:
    """The usual umask, under which SQLite's own files come out 0644."""
    old = os.umask(0o022)
    yield
    os.umask(old)


async def test_a_new_store_folder_and_its_files_are_private(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "discovery.sqlite"
    store = await open_store("file", str(path))
    try:
        await store.put("k", b"v")  # WAL mode: the -wal and -shm files exist from here
        assert mode(tmp_path / "a") == 0o700
        assert mode(tmp_path / "a" / "b") == 0o700
        for name in ("discovery.sqlite", "discovery.sqlite-wal", "discovery.sqlite-shm"):
            assert mode(path.parent / name) == 0o600, name
    finally:
        await store.close()


async def test_an_existing_readable_store_is_narrowed(tmp_path: Path) -> None:
    """A store left by an older turnout (SQLite's own 0644 files) is made private."""
    path = tmp_path / "discovery.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA journal_mode=WAL")
    for name in ("discovery.sqlite", "discovery.sqlite-wal"):
        (tmp_path / name).touch()
        os.chmod(tmp_path / name, 0o644)
    store = await open_store("file", str(path))
    try:
        assert mode(path) == 0o600
        assert mode(tmp_path / "discovery.sqlite-wal") == 0o600
    finally:
        await store.close()


@pytest.mark.parametrize("folder_mode", [0o777, 0o770, 0o1777, 0o757], ids=lambda m: f"{m:04o}")
async def test_a_folder_others_may_write_in_is_refused(tmp_path: Path, folder_mode: int) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, folder_mode)
    with pytest.raises(
        ConfigError, match=rf"refusing the store folder {folder}: mode 0?{folder_mode:o}"
    ):
        await open_store("file", str(folder / "discovery.sqlite"))
    assert not (folder / "discovery.sqlite").exists()


async def test_a_sticky_parent_is_fine_when_the_folder_is_ours(tmp_path: Path) -> None:
    """``/tmp`` itself is writable by all, but sticky: no one can rename a folder of ours."""
    parent = tmp_path / "like-tmp"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    store = await open_store("file", str(parent / "turnout-me" / "discovery.sqlite"))
    await store.close()
    assert mode(parent / "turnout-me") == 0o700


def test_the_command_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    result = subprocess.run(
        [sys.executable, "-m", "turnout", "status", "--store-path", str(folder / "d.sqlite")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refusing the store folder" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


@needs_root
async def test_a_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"{folder}: it belongs to user {NOBODY}, not to you"):
        await open_store("file", str(folder / "discovery.sqlite"))


@needs_root
async def test_a_folder_of_ours_inside_one_of_another_user_is_refused(tmp_path: Path) -> None:
    """Its owner could rename our folder away and put theirs in its place."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "mine").mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"{theirs}: it belongs to user {NOBODY}"):
        await open_store("file", str(theirs / "mine" / "discovery.sqlite"))


@needs_root
async def test_a_store_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "discovery.sqlite"
    path.write_bytes(b"")
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"belongs to user {NOBODY}"):
        await open_store("file", str(path))


@needs_root
async def test_a_symlinked_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    """In a sticky ``/tmp``, another user may make ``turnout-<uid>`` a link to their folder."""
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "turnout-me"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=f"symlink of user {NOBODY}"):
        await open_store("file", str(link / "discovery.sqlite"))


def test_the_default_folder_prefers_xdg_runtime_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TURNOUT_STORE_PATH", raising=False)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    assert default_file_store_path() == f"{run}/turnout/discovery.sqlite"
    assert default_file_store_path("serve-8000") == f"{run}/turnout/serve-8000/discovery.sqlite"
    fallback = f"/tmp/turnout-{os.getuid()}/discovery.sqlite"
    os.chmod(run, 0o777)  # not a runtime folder the spec allows: not used
    assert default_file_store_path() == fallback
    for unusable in ("", "relative/run", str(tmp_path / "missing")):
        monkeypatch.setenv("XDG_RUNTIME_DIR", unusable)
        assert default_file_store_path() == fallback
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_file_store_path() == fallback


async def test_the_default_store_is_made_private_under_xdg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TURNOUT_STORE_PATH", raising=False)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    store = await open_store("file")
    await store.close()
    assert mode(run / "turnout") == 0o700
    assert mode(run / "turnout" / "discovery.sqlite") == 0o600
