"""Where the file store lives, and whether it is ours to trust.

The store decides which workers a frontend sends prompts to: whoever can write the file can
register an instance of their own, and whoever can read it learns the deployment. So the
file is trusted only when the current user alone can change it:

* The default folder is ``$XDG_RUNTIME_DIR/turnout`` when that variable names a usable
  runtime folder (a directory of this user, writable by no one else, as the XDG spec asks of
  it), else ``/tmp/turnout-<uid>``: a shared folder, where another local user may have made
  that name first.
* A missing folder is made ``0700``, and so is every parent turnout makes on the way. An
  existing one must be owned by this user and writable by no group and no one else;
  otherwise the store is refused with a ``ConfigError`` that names the folder and says why.
  Parents up to the first owned by root are checked too (someone else's parent could swap
  the folder for theirs); a sticky parent (``/tmp``) lets no one else rename what is ours.
* The database is made ``0600`` before SQLite opens it, so its ``-wal`` and ``-shm`` files,
  which SQLite creates with the database's mode, are private too; existing ones of this user
  are narrowed to ``0600``, a symlink or another user's file is refused.
"""

from __future__ import annotations

import os
import stat

from turnout.errors import ConfigError

#: The database's companions, which SQLite creates beside it in WAL mode.
SIDE_FILES = ("-wal", "-shm", "-journal")


def runtime_folder() -> str:
    """The folder of turnout's default stores: ``$XDG_RUNTIME_DIR/turnout`` when that runtime
    folder is usable, else ``/tmp/turnout-<uid>``."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and _usable_runtime_dir(xdg):
        return os.path.join(xdg, "turnout")
    return f"/tmp/turnout-{os.getuid()}"


def _usable_runtime_dir(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.getuid()
        and not st.st_mode & 0o022
        and os.access(path, os.W_OK | os.X_OK)
    )


def secure_folder(folder: str) -> None:
    """Make ``folder`` (mode 0700, missing parents too), or check that an existing one is this
    user's alone; ``ConfigError`` naming it otherwise."""
    folder = os.path.abspath(folder)
    missing: list[str] = []
    probe = folder
    while not os.path.lexists(probe):
        missing.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # made meanwhile, by another process: checked below like any folder
        except OSError as exc:
            raise ConfigError(f"cannot create the store folder {path}: {exc.strerror}") from None
    _check_folder(folder, strict=True)
    parent = os.path.dirname(folder)
    while parent != folder:
        if not _check_folder(parent, strict=False):
            break
        folder, parent = parent, os.path.dirname(parent)


def _check_folder(path: str, *, strict: bool) -> bool:
    """Refuse ``path`` unless this user owns it and no one else may write in it. ``strict``:
    the store's own folder, whoever else may write in it could plant the database's side
    files; a parent may be root's, or writable by others when sticky (no one can rename what
    is ours). Returns whether to go on with its parent: not past root's, the system's."""
    try:
        link = os.lstat(path)
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot use the store folder {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"the store folder {path} is not a directory")
    uid = os.getuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        raise ConfigError(
            f"refusing the store folder {path}: it is a symlink of user {link.st_uid}, "
            "not yours; choose another --store-path"
        )
    if st.st_uid != uid and (strict or st.st_uid != 0):
        raise ConfigError(
            f"refusing the store folder {path}: it belongs to user {st.st_uid}, not to you "
            f"({uid}), and its owner could register workers of their own; remove it or "
            "choose another --store-path"
        )
    if st.st_mode & 0o022 and (strict or not st.st_mode & stat.S_ISVTX):
        raise ConfigError(
            f"refusing the store folder {path}: mode {stat.S_IMODE(st.st_mode):04o} lets "
            f"others write in it; run chmod 700 {path} or choose another --store-path"
        )
    return st.st_uid != 0


def private_file(path: str) -> None:
    """Create the database ``path`` with mode 0600 (before SQLite does, with its 0644), or
    narrow an existing one of this user, and its side files, to 0600; ``ConfigError`` for a
    symlink or a file of another user."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open the store {path}: {exc.strerror}") from None
    try:
        _check_file(path, os.fstat(fd), fd)
    finally:
        os.close(fd)
    for suffix in SIDE_FILES:
        side = path + suffix
        try:
            st = os.lstat(side)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(f"refusing the store {path}: {side} is a symlink")
        _check_file(side, st, None)


def _check_file(path: str, st: os.stat_result, fd: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"refusing the store {path}: not a regular file")
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"refusing the store {path}: it belongs to user {st.st_uid}, not to you "
            f"({os.getuid()}); remove it or choose another --store-path"
        )
    if st.st_mode & 0o077:
        if fd is not None:
            os.fchmod(fd, 0o600)
        else:
            os.chmod(path, 0o600)
