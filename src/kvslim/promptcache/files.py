"""Prompt cache files on disk: the atomic write, the reads, and the check that a written file reads back.

A file is a safetensors file (sorted tensor names, no timestamps: the same snapshot gives the same bytes)
whose metadata key :data:`~.header.META_KEY` holds the JSON header. A write goes to a temporary beside
the target, is flushed, re-opened and checked (the same tensor names and header), then renamed over the
target (:mod:`kvslim.atomic`); a failure leaves an existing file as it was. Every read error is one
ValueError line naming the file.

This module moves ``(tensors, header)`` snapshots between memory and disk. It knows nothing about caches
(what a snapshot holds and how a cache is rebuilt from one: :mod:`.state`) nor about whether a saved
cache may continue a prompt (:mod:`.continuation`).
"""

from __future__ import annotations

import json
import os

import torch

from .header import META_KEY, check_header, first_line


def write_state(tensors: dict[str, torch.Tensor], header: dict, path: str | os.PathLike, *, mode=None) -> None:
    """Write a :func:`~kvslim.promptcache.to_state` snapshot to ``path`` atomically: a temporary file beside
    it, flushed, re-opened and checked, renamed over ``path``; a failure leaves an existing file as it was
    (:class:`~kvslim.atomic.WriteError`). mode: the file's exact permission bits (``0o600``: private from the
    first byte; None: as ``open()`` makes it). The snapshot holds its own CPU copies, so the cache it came
    from may change while this writes (a server's background writer)."""
    from safetensors.torch import save_file  # looked up per call: tests replace it with a failing disk

    from ..atomic import atomic_path

    metadata = {META_KEY: json.dumps(header, sort_keys=True, separators=(",", ":"))}

    def verify(tmp) -> None:
        names, meta = open_file(tmp, where=f"prompt cache {os.fspath(path)}")
        if names != set(tensors) or meta != header:
            raise ValueError(
                "the file written does not read back as the cache (tensor names or header differ)"
            )

    with atomic_path(path, verify=verify, what="prompt cache", mode=mode) as tmp:
        save_file(tensors, os.fspath(tmp), metadata=metadata)


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header of a prompt cache file, checked (format, version), without reading the tensors.
    ValueError (one line naming the file) for a file that is not one this kvslim reads."""
    _, header = open_file(path, where=where_of(path))
    return header


def read_tensors(path: str | os.PathLike, *, where: str) -> dict[str, torch.Tensor]:
    """Every tensor of a prompt cache file, on the CPU. ValueError (one line, ``where``) for a damaged or
    truncated file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(os.fspath(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{where}: cannot read its tensors ({first_line(e)}): a damaged or truncated file") from None


def read_tensor(path: str | os.PathLike, name: str) -> torch.Tensor:
    """One tensor of a safetensors file, without reading the others. safetensors' own errors (SafetensorError,
    OSError, RuntimeError, ValueError) pass through: the caller says what they mean."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        return f.get_tensor(name)


def open_file(path, *, where: str) -> tuple[set[str], dict]:
    """(tensor names, checked header) of a prompt cache file; ValueError (one line, ``where``) for a missing
    file, one that is not safetensors, or one without a header this kvslim reads."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise ValueError(f"{where}: no such file")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            names, meta = set(f.keys()), f.metadata() or {}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{where}: not a readable safetensors file ({first_line(e)}): damaged or truncated"
        ) from None
    if META_KEY not in meta:
        raise ValueError(f"{where}: a safetensors file without a kvslim prompt cache header")
    try:
        header = json.loads(meta[META_KEY])
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: its header is not JSON ({e.msg}): a damaged file") from None
    check_header(header, where=where)
    return names, header


def where_of(path: str | os.PathLike) -> str:
    """How an error names a prompt cache file: ``prompt cache <path>``."""
    return f"prompt cache {os.fspath(path)}"
