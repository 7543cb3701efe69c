"""Atomic file writes: every file kvslim writes appears whole or not at all.

A write goes to a temporary file beside the target (same directory, so the final rename cannot
cross file systems), is flushed and fsynced, optionally checked by the caller (a GGUF file is
re-opened and parsed, a JSON file re-read), and only then renamed over the target. If anything
fails -- a full disk (ENOSPC), a file-size limit (EFBIG, ``ulimit -f``), a read-only file system, a
check that does not pass, Ctrl-C -- the temporary file is removed, the old target is untouched, and
the error is a :class:`WriteError` whose message is one line naming the target and the reason.

The same steps for a directory (the converted model copy) are :func:`fsync_tree` and
:func:`replace_dir`.

This module knows nothing about what is written; callers own the format and the check.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

#: Marks kvslim's temporary files: ``.<name>.kvslim-tmp-<random><suffix>`` (hidden, and ending
#: in the target's suffix so that writers choosing a format by extension -- matplotlib -- agree).
TMP_TAG = ".kvslim-tmp-"


class WriteError(OSError):
    """A file could not be written; the target (if it existed) is unchanged. ``str()`` is one line."""

    def __str__(self) -> str:  # OSError's str() would add "[Errno N]"
        return self.args[0] if self.args else "write failed"


def check_writable_target(path: str | os.PathLike, what: str = "output") -> Path:
    """Cheap checks of an output path before any slow work: its directory exists and it is not a
    directory itself. Raises :class:`WriteError` (one line). Returns the path."""
    target = Path(path)
    if target.is_dir():
        raise WriteError(f"{what} {os.fspath(path)}: is a directory, expected a file path")
    # The final rename would replace a symlink (or a device, a FIFO) with a regular file: refuse instead.
    if target.is_symlink():
        raise WriteError(
            f"{what} {os.fspath(path)}: is a symbolic link (to {os.readlink(target)}), expected a regular file "
            f"path; pass the link's target itself"
        )
    if target.exists() and not target.is_file():
        raise WriteError(f"{what} {os.fspath(path)}: is not a regular file (a device or a pipe), expected a file path")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise WriteError(f"{what} {os.fspath(path)}: directory {parent.resolve()} does not exist")
    return target


def _reason(e: BaseException, directory: Path | None = None) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        return f"{e.strerror or os.strerror(e.errno)} ({name})"
    text = str(e).strip().splitlines()
    reason = text[0] if text else type(e).__name__
    if isinstance(e, OSError) and directory is not None:  # numpy's tofile: "N requested and M written"
        with contextlib.suppress(OSError, AttributeError):
            st = os.statvfs(directory)
            reason += f" (a short write: {st.f_bavail * st.f_frsize} bytes free there; disk full or a file-size limit)"
    return reason


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (best effort: some file systems refuse fsync on a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temp_beside(target: Path, mode: int | None = None) -> tuple[Path, int]:
    """Create an empty temporary file next to ``target``: (path, fd). Mode 0o666 minus the umask, as
    ``open(target, "w")`` would create it, or exactly ``mode`` (set before any byte is written: a private
    file is never readable by others, not even while it is being written)."""
    for _ in range(100):
        tmp = target.with_name(f".{target.stem}{TMP_TAG}{secrets.token_hex(4)}{target.suffix}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        except FileExistsError:
            continue
        if mode is not None:
            try:
                os.fchmod(fd, mode)  # the umask may have removed bits the caller asked for
            except BaseException:
                os.close(fd)
                _unlink(tmp)
                raise
        return tmp, fd
    raise FileExistsError(f"no free temporary name beside {target}")  # pragma: no cover


def _begin(path: str | os.PathLike, what: str, mode: int | None = None) -> tuple[Path, Path]:
    """(target, temporary file created beside it); WriteError if the directory refuses it."""
    target = check_writable_target(path, what)
    try:
        tmp, fd = _temp_beside(target, mode)
        os.close(fd)
    except OSError as e:
        raise WriteError(f"cannot write {what} {os.fspath(path)}: {_reason(e)}") from e
    return target, tmp


def _finish(
    target: Path, tmp: Path, verify: Callable[[Path], object] | None, mode: int | None = None
) -> None:
    """fsync ``tmp``, check it, rename it over ``target``. Raises whatever fails (caller cleans up).
    The file keeps an existing target's permissions, or gets exactly ``mode`` when one is given (set
    again here, in case the writer replaced the temporary instead of writing into it)."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if verify is not None:
        verify(tmp)
    if mode is not None:
        os.chmod(tmp, mode)
    else:
        with contextlib.suppress(OSError):
            if target.exists():  # keep an existing file's permissions
                os.chmod(tmp, target.stat().st_mode & 0o7777)
    os.replace(tmp, target)
    _fsync_dir(target.parent if str(target.parent) else Path("."))


def _failed(target: Path, tmp: Path, e: BaseException, what: str) -> BaseException:
    """Remove ``tmp``; the exception to raise for ``e`` (a one-line WriteError, or ``e`` itself for
    KeyboardInterrupt/SystemExit and an existing WriteError)."""
    _unlink(tmp)
    if isinstance(e, (KeyboardInterrupt, SystemExit, WriteError)):
        return e
    unchanged = "the existing file is unchanged" if target.exists() else "nothing was written"
    err = WriteError(f"cannot write {what} {os.fspath(target)}: {_reason(e, target.parent)}; {unchanged}")
    err.__cause__ = e
    return err


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike,
    *,
    verify: Callable[[Path], object] | None = None,
    what: str = "output",
    mode: int | None = None,
) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for a writer that wants a file name (GGUFWriter,
    matplotlib, ...); when the block ends normally, fsync it, run ``verify(tmp)`` (which raises if
    the file is not what was meant), and rename it over ``path``.

    mode: the file's permission bits, exactly (e.g. ``0o600`` for a private file: the temporary is
    created with them, so it is never readable by others); None: as ``open()`` would create it, or an
    existing target's.

    On any exception (or a failed check) the temporary file is removed, the target is unchanged,
    and the error is raised as :class:`WriteError` (KeyboardInterrupt and SystemExit pass through).
    """
    target, tmp = _begin(path, what, mode)
    try:
        yield tmp
        _finish(target, tmp, verify, mode)
    except BaseException as e:
        err = _failed(target, tmp, e, what)
        if err is e:
            raise
        raise err from e


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class AtomicFile:
    """A file written over time (a log) that replaces ``path`` only on :meth:`commit`.

    ``f = AtomicFile(path, "w")``, write to ``f.file``, then ``f.commit()`` (flush, fsync, check,
    rename) or ``f.discard()`` (the temporary file is removed, the target untouched). Also a context
    manager: commit on success, discard on error.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        mode: str = "w",
        *,
        encoding: str | None = "utf-8",
        verify: Callable[[Path], object] | None = None,
        what: str = "output",
    ):
        if mode not in ("w", "wb"):
            raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
        self.what, self.verify = what, verify
        self.target, self.tmp = _begin(path, what)
        try:
            self.file: IO = open(self.tmp, mode, encoding=None if "b" in mode else encoding)  # noqa: SIM115
        except BaseException as e:
            err = _failed(self.target, self.tmp, e, what)
            if err is e:
                raise
            raise err from e
        self._done = False

    @property
    def closed(self) -> bool:
        """Committed or discarded."""
        return self._done

    def write(self, data) -> None:
        """Write to the temporary file; a failure (disk full) is a one-line WriteError."""
        try:
            self.file.write(data)
        except OSError as e:
            self.discard()
            raise _failed(self.target, self.tmp, e, self.what) from e

    def commit(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self.file.flush()
            self.file.close()
            _finish(self.target, self.tmp, self.verify)
        except BaseException as e:
            with contextlib.suppress(OSError):
                self.file.close()
            err = _failed(self.target, self.tmp, e, self.what)
            if err is e:
                raise
            raise err from e

    def discard(self) -> None:
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):
            self.file.close()
        _unlink(self.tmp)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def write_bytes(path: str | os.PathLike, data: bytes, *, verify=None, what: str = "output") -> None:
    """Atomically write ``data`` to ``path`` (see :func:`atomic_path`)."""
    with atomic_path(path, verify=verify, what=what) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, *, verify=None, what: str = "output") -> None:
    """Atomically write ``text`` (UTF-8) to ``path``."""
    write_bytes(path, text.encode("utf-8"), verify=verify, what=what)


def write_json(path: str | os.PathLike, obj, *, what: str = "output") -> None:
    """Atomically write ``obj`` as strict JSON (``allow_nan=False``: a NaN raises ValueError here,
    before anything is written), re-read and parsed before the rename."""
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n"

    def verify(tmp: Path) -> None:
        if json.loads(tmp.read_text(encoding="utf-8")) is None and obj is not None:  # pragma: no cover
            raise ValueError("the written JSON does not parse back")

    write_text(path, text, verify=verify, what=what)


def fsync_tree(directory: str | os.PathLike) -> None:
    """fsync every regular file under ``directory`` and the directories themselves (before a
    :func:`replace_dir`, so a crash cannot leave a renamed directory with empty files)."""
    root = Path(directory)
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> bool:
    """Rename the finished directory ``tmp`` to ``final`` (which must not exist). Returns False if
    another process put ``final`` in place first (a lost race; ``tmp`` is left for the caller to
    remove), raises OSError otherwise."""
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY) and Path(final).is_dir():
            return False
        raise
    _fsync_dir(Path(final).parent)
    return True


def remove_stale(directory: str | os.PathLike, pattern: str, max_age_s: float = 3600.0) -> None:
    """Remove what killed processes left in ``directory``: entries matching the glob ``pattern``, owned
    by this user and untouched for ``max_age_s`` seconds (a live writer's temporary is younger); a file
    is unlinked, a directory removed whole, a link left alone. Errors are ignored (another process may
    be removing the same entries). The one stale-temporary cleaner: kernel builds (:mod:`kvslim.kernels.clib`),
    their private build directories, and what else writes temporaries beside its target."""
    import shutil
    import stat
    import time

    now = time.time()
    with contextlib.suppress(OSError):
        for entry in Path(directory).glob(pattern):
            with contextlib.suppress(OSError):
                st = entry.lstat()
                mine = not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
                if not mine or now - st.st_mtime <= max_age_s:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(entry, ignore_errors=True)
                elif stat.S_ISREG(st.st_mode):
                    entry.unlink()
