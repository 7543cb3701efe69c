"""The prompt cache header: its schema, its check, and the checksum over a file's content.

The header is the JSON object a prompt cache file keeps under the safetensors metadata key ``kvslim``
(:data:`META_KEY`); its fields are listed in :mod:`kvslim.promptcache`. This module knows the header's
fields and their JSON types, the layout version this kvslim reads, and how a content checksum is taken;
it knows nothing about caches (what fills a header: :mod:`.state`), files (:mod:`.files`) or whether a
saved cache may continue a prompt (:mod:`.continuation`).
"""

from __future__ import annotations

import hashlib
import json

import torch

#: What the ``format`` field of the header says.
FORMAT = "kvslim-prompt-cache"
#: The layout version this kvslim writes and reads; a file of a newer version is refused.
FORMAT_VERSION = 1
#: The safetensors metadata key holding the JSON header.
META_KEY = "kvslim"

#: The header's fields and their JSON types (check_header), and those of one K/V layer's entry.
_HEADER = {
    "cache_config": str,
    "levers": dict,
    "model": dict,
    "padding": dict,
    "layers": list,
    "mean_center": (dict, type(None)),
    "tokens": (list, type(None)),
    "sha256": str,
}
_KV_LAYER = {
    "seen": int,
    "base": int,
    "runs": list,
    "dtype": (str, type(None)),
    "kv_shape": (list, type(None)),
    "v_dim": int,
    "k_offset": int,
    "v_offset": int,
}


def check_header(header, *, where: str = "prompt cache") -> None:
    """ValueError unless ``header`` is a prompt cache header this kvslim reads (format, version, fields)."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{where}: not a kvslim prompt cache (no {FORMAT!r} header)")
    version = header.get("version")
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"{where}: layout version {version!r} is not valid (expected {FORMAT_VERSION})")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{where}: written by a newer kvslim (layout version {version}; this kvslim reads {FORMAT_VERSION}): "
            f"upgrade kvslim or prefill again"
        )
    missing = [k for k in _HEADER if not isinstance(header.get(k), _HEADER[k])]
    for i, entry in enumerate(header.get("layers") or []):
        kind = entry.get("kind") if isinstance(entry, dict) else None
        fields = {"dummy": {}, "kv": _KV_LAYER}.get(kind)
        if fields is None:
            missing.append(f"layers[{i}].kind")
            continue
        missing += [f"layers[{i}].{k}" for k in fields if not isinstance(entry.get(k), fields[k])]
    if missing:
        raise ValueError(f"{where}: the header lacks or mistypes {', '.join(missing[:4])} (a damaged file)")


def content_sha256(tensors: dict[str, torch.Tensor], header: dict) -> str:
    """sha256 over the header (all but its ``sha256`` field, as sorted compact JSON) and every tensor's name,
    dtype, shape and bytes, in sorted name order: ``sha256:<hex>``."""
    h = hashlib.sha256()
    rest = {k: v for k, v in header.items() if k != "sha256"}
    h.update(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{dtype_name(t.dtype)}:{tuple(t.shape)};".encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the header writes it: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | None) -> torch.dtype | None:
    """The dtype a header names (None stays None); ValueError for a name torch does not know."""
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (a library's multi-line error, cut for a one-line one)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
