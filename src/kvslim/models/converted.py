"""The embedded model's converted copy: a GGUF unpacked once (~25 s) and saved as safetensors + tokenizer
under :func:`cache_dir`, so that later loads read that copy in seconds.

The copy is not trusted blindly: its completion marker records every file's size and sha256 and the
model's fingerprint. Every load checks the sizes (a stat per file) and, after loading, the fingerprint
(milliseconds); the hashes are checked when either fails, when loading fails, or with ``verify=True``
(``--verify``). A damaged copy is converted again (with a one-line warning); when that is impossible, the
error says which directory to delete. A conversion is written into a temporary directory beside the final
one and renamed into place; what killed processes left is removed by :func:`kvslim.atomic.remove_stale`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..calibration.fingerprint import model_fingerprint
from .sources import _first_line, _from_dir, _from_gguf, _one_line, _quiet_progress, embedded_gguf_path

#: Bump when the converted copy's layout changes, so old copies are not reused.
_CONVERSION_VERSION = 1
_MARKER = "kvslim-source.json"


def cache_dir() -> Path:
    """kvslim's cache directory: ``$KVSLIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvslim``, else
    ``~/.cache/kvslim``. Not created here."""
    from ..paths import cache_dir as kvslim_cache_dir

    return kvslim_cache_dir()


def converted_dir(gguf_path: str | os.PathLike) -> Path:
    """Where the converted copy of ``gguf_path`` lives (whether or not it exists yet).

    The name carries a digest of the file's name, size and modification time: a reinstalled or
    replaced file gets a fresh conversion, an unchanged one is never re-read (hashing the content
    would cost a read of the whole file on every start).
    """
    path = Path(gguf_path)
    st = path.stat()
    key = f"{path.name}:{st.st_size}:{st.st_mtime_ns}:v{_CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{path.stem}-{digest}"


def is_converted(gguf_path: str | os.PathLike | None = None) -> bool:
    """Whether the converted copy of ``gguf_path`` (default: the embedded model) is ready."""
    path = embedded_gguf_path() if gguf_path is None else Path(gguf_path)
    return (converted_dir(path) / _MARKER).is_file()


def check_cache_writable(gguf_path: str | os.PathLike | None = None) -> None:
    """ValueError (one line) unless the converted copy of ``gguf_path`` (default: the embedded model)
    can be saved: its parent directory can be created and written (not a read-only file system).
    Cheap, so a CLI can say so before announcing a conversion."""
    path = embedded_gguf_path() if gguf_path is None else Path(gguf_path)
    parent = converted_dir(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(
                errno.EROFS if _read_only(parent) else errno.EACCES, "not writable", str(parent)
            )
    except OSError as e:
        reason = os.strerror(e.errno) if e.errno else str(e)
        raise ValueError(
            f"cannot save the converted copy of {path.name} under {parent}: {reason}; set KVSLIM_CACHE_DIR "
            f"to a writable directory"
        ) from None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _load_embedded(gguf_path: Path, dtype: torch.dtype, *, verify: bool = False, **kwargs):
    """The embedded model from its converted copy (made, or made again, as needed)."""
    source, fresh = _ensure_converted(gguf_path, verify=verify, **kwargs)
    if fresh is not None:  # just converted: already in memory, in float32
        return fresh
    marker = _read_marker(source)
    # The fingerprint (bfloat16-rounded samples) is the same for float32 and bfloat16 weights but not for
    # float16 ones (rounded twice): a float16 load reads float32 and is checked; load_model casts it after.
    load_dtype = torch.float32 if dtype == torch.float16 else dtype
    try:
        with _quiet_progress():
            model, tokenizer = _from_dir(source, load_dtype, **kwargs)
        recorded = marker.get("fingerprint") if marker else None
        if recorded and model_fingerprint(model) != recorded:
            raise ValueError("the loaded weights do not match the fingerprint recorded at conversion")
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        problem = _copy_problem(source, hashes=True)
        if problem is None:
            if marker and "files" in marker:
                raise ValueError(f"cannot load the converted model copy {source}: {_first_line(e)}") from e
            problem = _first_line(e)  # an old marker records no hashes: trust the failure
        _warn(f"the converted model copy {source} is damaged ({problem}); converting it again")
        source, fresh = _ensure_converted(gguf_path, force=True, **kwargs)
        return fresh
    if marker is not None and "files" not in marker:
        _upgrade_marker(source, marker, model)
    return model, tokenizer


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _read_marker(directory: Path) -> dict | None:
    """The completion marker of a converted copy, or None if absent or unreadable."""
    try:
        marker = json.loads((directory / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _file_records(directory: Path) -> dict:
    """relative path -> {"size", "sha256"} of every file of a converted copy but the marker."""
    records = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != _MARKER:
            records[path.relative_to(directory).as_posix()] = {
                "size": path.stat().st_size,
                "sha256": _sha256_file(path),
            }
    return records


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _copy_problem(directory: Path, *, hashes: bool) -> str | None:
    """What is wrong with a converted copy, or None: the marker is missing or unreadable, a recorded
    file is missing or has another size, or (``hashes``) another sha256. An old marker without
    file records has nothing to check against (None)."""
    marker = _read_marker(directory)
    if marker is None:
        return f"no readable {_MARKER}"
    files = marker.get("files")
    if files is None:
        return None
    if not isinstance(files, dict) or not files:
        return f"{_MARKER} lists no files"
    for name, record in files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if not isinstance(record, dict) or size != record.get("size"):
            return f"{name} has {size} bytes, {record.get('size') if isinstance(record, dict) else '?'} were written"
    if hashes:
        for name, record in files.items():
            if _sha256_file(directory / name) != record.get("sha256"):
                return f"{name}'s content changed since it was written (sha256 differs)"
    return None


def _write_marker(directory: Path, gguf_path: Path, model) -> None:
    """The completion marker: the source GGUF's identity, every file's size and sha256, and the
    model's fingerprint. Written last, atomically."""
    from ..atomic import write_text

    st = gguf_path.stat()
    marker = dict(
        source=str(gguf_path),
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        version=_CONVERSION_VERSION,
        fingerprint=model_fingerprint(model),
        files=_file_records(directory),
    )
    write_text(directory / _MARKER, json.dumps(marker, indent=2) + "\n", what="conversion marker")


def _upgrade_marker(directory: Path, marker: dict, model) -> None:
    """Give a copy converted by an older kvslim (a marker without file records) sizes, hashes and a
    fingerprint, once, so later damage is detected. Best effort: a read-only cache stays as it is."""
    from ..atomic import WriteError, write_text

    upgraded = dict(marker, fingerprint=model_fingerprint(model), files=_file_records(directory))
    with contextlib.suppress(OSError, WriteError):
        write_text(directory / _MARKER, json.dumps(upgraded, indent=2) + "\n", what="conversion marker")


def _ensure_converted(
    gguf_path: Path, *, verify: bool = False, force: bool = False, **kwargs
) -> tuple[Path, tuple | None]:
    """The converted copy of ``gguf_path``, made now if missing or damaged: ``(directory, fresh)``
    where ``fresh`` is the ``(model, tokenizer)`` just converted (None when a good copy existed).

    A copy whose marker is present is checked (:func:`_copy_problem`: sizes, and hashes with
    ``verify``); ``force`` converts again regardless. Written into a temporary directory next to
    the final one, every file fsynced, the marker (sizes, hashes, fingerprint) written last, then
    renamed into place, so an interrupted conversion never leaves a directory that looks complete;
    two processes converting at once both succeed and one copy wins.
    """
    from ..atomic import fsync_tree, remove_stale, replace_dir

    final = converted_dir(gguf_path)
    if not force and (final / _MARKER).is_file():
        problem = _copy_problem(final, hashes=verify)
        if problem is None:
            return final, None
        _warn(f"the converted model copy {final} is damaged ({problem}); converting it again")
    check_cache_writable(gguf_path)
    try:
        remove_stale(final.parent, ".tmp-*")  # what killed conversions left (older than an hour)
        if final.exists():  # damaged, or a directory without a marker: not ours to trust
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    except OSError as e:
        what = "replace the damaged copy" if final.exists() else "save the converted copy"
        fix = f"delete {final} and run again, or set" if final.exists() else "set"
        raise ValueError(
            f"cannot {what} of {gguf_path.name} under {final.parent}: "
            f"{e.strerror or e} ({e.filename or final.parent}); {fix} KVSLIM_CACHE_DIR to a writable directory"
        ) from None
    try:
        model, tokenizer = _one_line(f"cannot convert {gguf_path}", _from_gguf, gguf_path, **kwargs)
        # a full disk while the weights are written is a SafetensorError, not an OSError
        from safetensors import SafetensorError

        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _write_marker(tmp, gguf_path, model)
            fsync_tree(tmp)
            if not replace_dir(tmp, final) and _copy_problem(final, hashes=False) is not None:
                raise OSError(f"another process left a damaged copy at {final}")
        except (OSError, SafetensorError) as e:
            raise ValueError(
                f"cannot save the converted copy of {gguf_path.name} under {final.parent}: "
                f"{getattr(e, 'strerror', None) or _first_line(e)}; free some space or set KVSLIM_CACHE_DIR to a "
                f"writable directory"
            ) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final, (model, tokenizer)
