"""The K mean-centering bias file: GGUF in the layout of PrismML's llama.cpp fork, deterministic bytes.

The fork (PrismML-Eng/llama.cpp PR #51, ``--kv-mean-center``, ``common/kv-mean-center.cpp``) stores
one F32 tensor ``kv_bar.blk.<il>.k`` of ``head_dim * n_kv_heads`` values per layer, channel fastest,
next to ``general.type = kv-mean-center``, ``kv_mean_center.schema_version``, ``model_sha256`` and
``k_rot``. kvslim writes the same keys and bytes and adds its provenance keys (cache type, channel
order, calibration text and chunks); it reads files of either tool. See docs/mean-center.md.

Deterministic files (as gguf-py's imatrix): tensors in layer order, keys in a fixed order, no
timestamps, so the same :class:`~kvslim.calibration.biasset.BiasSet` always gives the same bytes.

Deviation from the fork: for llama-arch models llama.cpp's converter permutes the K channels
(interleaved vs rotate-half RoPE), so a bias is only portable after a conversion, which is its own fact
and module (:mod:`.channelorder`). kvslim's files record their order (``kv_mean_center.channel_order``);
a file without that key is the fork's, in llama.cpp's order
(:func:`~kvslim.calibration.channelorder.file_channel_order`), converted on load for the architectures
whose order differs.

Writing is atomic (:mod:`kvslim.atomic`): a temporary file beside the target, re-read and compared
before it is renamed over the target, so a failed write (a full disk, a file-size limit) leaves the
old file intact. Reading refuses anything but a well-formed file, with a one-line ValueError: a
truncated or random file, a malformed field, a duplicate or non-canonical tensor name
(``kv_bar.blk.01.k``), a structure whose declared lengths exceed the file (checked before gguf-py
parses it, which would otherwise loop over a forged array length).

This module knows the bytes and names of the file; it does not know channel orders
(:mod:`.channelorder`), check a bias against a model's shapes (:func:`kvslim.calibration.meancenter.load_mean_center` does), measure one (:mod:`kvslim.calibration.calibrate`) or
apply one (the cache layer does).
"""

from __future__ import annotations

import os
import re
import struct

import numpy as np
import torch

from .biasset import CHANNEL_ORDERS, METHOD, ROLES, BiasSet, check_layer, rotation_name, tensor_name

#: ``general.type`` of a bias file (the fork's value).
FILE_TYPE = "kv-mean-center"
#: ``kv_mean_center.schema_version`` of a file without fitted rotations (the fork's; what this module writes
#: for one, byte for byte as before schema 2 existed).
SCHEMA_VERSION = 1
#: ``kv_mean_center.schema_version`` of a file with fitted rotations (``kv_rot.blk.<il>.k/v`` tensors and the
#: ``kv_mean_center.rotation`` key, :mod:`.rotation`). Both versions are read.
SCHEMA_VERSION_ROTATION = 2
#: Prefix of the fork's metadata keys.
KEY_PREFIX = "kv_mean_center."
#: ``kv_mean_center.model_sha256_kind``: whose identity ``model_sha256`` holds.
FINGERPRINT_KIND = "kvslim"
#: Canonical tensor names only: ``kv_bar.blk.1.k``, never ``kv_bar.blk.01.k`` (an alias of layer 1).
_TENSOR_RE = re.compile(r"^kv_bar\.blk\.(0|[1-9][0-9]{0,5})\.k$")
_TENSOR_LIKE = re.compile(r"^kv_(bar|rot)\.blk\.")
#: Canonical names of the fitted rotations (schema 2): ``kv_rot.blk.<il>.k`` and ``kv_rot.blk.<il>.v``.
_ROT_RE = re.compile(r"^kv_rot\.blk\.(0|[1-9][0-9]{0,5})\.(k|v)$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: A bias file holds a few hundred KiB (80 layers x 8 heads x 128 channels x 4 bytes = 320 KiB);
#: anything larger is not one (and is not read into memory to find out).
#: Schema 2 adds two (H_kv, D, D) float32 rotations a layer: 80 x 8 x 128^2 x 4 B x 2 = 80 MiB at most today.
MAX_FILE_BYTES = 256 << 20


def fingerprint_hex(fingerprint: str) -> str:
    """``sha256:<hex>`` (or bare hex) -> the 64 lowercase hex digits the fork's format stores."""
    digits = fingerprint.lower().removeprefix("sha256:")
    if not _HEX64.match(digits):
        raise ValueError(f"model_fingerprint must be 'sha256:' + 64 hex digits, got {fingerprint!r}")
    return digits


# ----------------------------------------------------------------------------------------------
# Writing


def write_bias_file(path: str | os.PathLike, bias: BiasSet) -> None:
    """Write ``bias`` as a GGUF file in the fork's layout plus kvslim's provenance keys.

    Keys, in this order: ``general.type`` = ``kv-mean-center``, ``kv_mean_center.schema_version``
    (u32, 1), ``kv_mean_center.model_sha256`` (kvslim's fingerprint as 64 hex digits, when known),
    ``kv_mean_center.k_rot`` (bool), ``kv_mean_center.k_pre_rope`` (bool: K before RoPE; kvslim's, the
    fork has no such basis and ignores it), then ``model_sha256_kind`` (str, ``kvslim``, with the
    fingerprint), ``cache_type`` (str), ``channel_order`` (str), ``n_tokens`` (u64),
    ``text_sha256`` (str), ``ctx`` (u32), ``n_chunks`` (u32) under ``kv_mean_center.``, each when
    known. Tensors ``kv_bar.blk.<il>.k``, F32, in layer order, numpy shape ``(H_kv, D)`` = GGUF
    ``ne=[D, H_kv]`` (channel fastest; the fork writes the same bytes as 1-D ``ne=[D*H_kv]``).
    No timestamps: the same BiasSet gives the same bytes.

    Schema 2 (``bias.rotations`` set, :mod:`.rotation`): ``schema_version`` is 2, ``kv_mean_center.rotation``
    (str, the fit method) follows ``n_chunks``, and after the bias tensors come ``kv_rot.blk.<il>.k`` then
    ``kv_rot.blk.<il>.v`` per layer in layer order, F32, numpy ``(H_kv, D, D)`` = GGUF ``ne=[D, D, H_kv]``
    (``R[h, e, d]``, ``y_e = sum_d R[h, e, d] x_d``). A set without rotations writes schema 1, the same bytes
    as before schema 2 existed.

    Atomic (:func:`kvslim.atomic.atomic_path`): written to a temporary file beside ``path``, re-read
    and compared with ``bias``, then renamed over ``path``. On failure ``path`` is unchanged and the
    error is a one-line :class:`kvslim.atomic.WriteError` (an OSError).
    """
    from gguf import GGUFWriter

    if not bias.tensors:
        raise ValueError("the bias set has no tensors")
    arrays = []
    for il, t in enumerate(bias.tensors):
        t = torch.as_tensor(t)
        if t.dim() not in (1, 2) or not t.dtype.is_floating_point:
            raise ValueError(
                f"{tensor_name(il)}: expected a 1-D or 2-D float tensor (H_kv, D), got "
                f"shape {tuple(t.shape)} dtype {t.dtype}"
            )
        a = t.detach().to(torch.float32).cpu().contiguous().numpy()
        if not np.isfinite(a).all():
            raise ValueError(f"{tensor_name(il)} has {int((~np.isfinite(a)).sum())} non-finite values")
        arrays.append(a)
    rot_arrays = _rotation_arrays(bias, len(arrays))
    from ..atomic import atomic_path

    def verify(tmp) -> None:
        """The file on disk parses back to exactly what was meant (a truncated write cannot pass)."""
        layers, meta, rotations = read_file(tmp)
        if sorted(layers) != list(range(len(arrays))) or any(
            layers[il].shape != a.shape or not np.array_equal(layers[il], a) for il, a in enumerate(arrays)
        ):
            raise ValueError("the written tensors do not read back equal")
        got_rot = {(il, r): a for r, per in rotations.items() for il, a in per.items()}
        if sorted(got_rot) != sorted(rot_arrays) or any(
            not np.array_equal(got_rot[k], a) for k, a in rot_arrays.items()
        ):
            raise ValueError("the written rotations do not read back equal")
        expected = {k: v for k, v in bias.metadata().items() if k not in ("architecture",)}
        expected["rotation"] = (bias.rotation or METHOD) if rot_arrays else None
        got = {k: v for k, v in meta.items() if k in expected}
        if bias.model_fingerprint:
            expected["model_fingerprint"] = "sha256:" + fingerprint_hex(bias.model_fingerprint)
        if got != expected:
            raise ValueError(f"the written metadata reads back as {got}, expected {expected}")

    fingerprint = fingerprint_hex(bias.model_fingerprint) if bias.model_fingerprint else None
    if bias.channel_order is not None and bias.channel_order not in CHANNEL_ORDERS:
        raise ValueError(f"channel_order must be one of {CHANNEL_ORDERS} or None, got {bias.channel_order!r}")
    with atomic_path(path, verify=verify, what="bias file") as tmp:
        # arch="" keeps general.architecture out (GGUFWriter skips empty strings): a bias file is not
        # a model, and the fork's files have no such key.
        writer = GGUFWriter(os.fspath(tmp), arch="")
        writer.add_type(FILE_TYPE)
        writer.add_uint32(KEY_PREFIX + "schema_version", SCHEMA_VERSION_ROTATION if rot_arrays else SCHEMA_VERSION)
        if fingerprint:
            writer.add_string(KEY_PREFIX + "model_sha256", fingerprint)
        writer.add_bool(KEY_PREFIX + "k_rot", bool(bias.k_rot))
        writer.add_bool(KEY_PREFIX + "k_pre_rope", bool(bias.pre_rope))
        if fingerprint:
            writer.add_string(KEY_PREFIX + "model_sha256_kind", FINGERPRINT_KIND)
        if bias.cache_type:
            writer.add_string(KEY_PREFIX + "cache_type", bias.cache_type)
        if bias.channel_order:
            writer.add_string(KEY_PREFIX + "channel_order", bias.channel_order)
        if bias.n_tokens is not None:
            writer.add_uint64(KEY_PREFIX + "n_tokens", int(bias.n_tokens))
        if bias.text_sha256:
            writer.add_string(KEY_PREFIX + "text_sha256", bias.text_sha256)
        if bias.ctx is not None:
            writer.add_uint32(KEY_PREFIX + "ctx", int(bias.ctx))
        if bias.n_chunks is not None:
            writer.add_uint32(KEY_PREFIX + "n_chunks", int(bias.n_chunks))
        if rot_arrays:
            writer.add_string(KEY_PREFIX + "rotation", bias.rotation or METHOD)
        for il, a in enumerate(arrays):
            writer.add_tensor(tensor_name(il), a)
        for role in ROLES if rot_arrays else ():  # all K rotations in layer order, then all V rotations
            for il in range(len(arrays)):
                writer.add_tensor(rotation_name(il, role), rot_arrays[(il, role)])
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()


def _rotation_arrays(bias: BiasSet, n_layers: int) -> dict[tuple[int, str], np.ndarray]:
    """``(layer, role)`` -> the float32 ``(H, D, D)`` array of each fitted rotation of ``bias`` (empty: none).
    ValueError for a set whose rotations do not cover every layer of both roles, or are not 3-D finite."""
    if not bias.rotations:
        return {}
    if bias.channel_order != CHANNEL_ORDERS[0]:
        raise ValueError(
            f"fitted rotations are written in transformers' channel order only, the set is in {bias.channel_order!r}"
        )
    out = {}
    for role in ROLES:
        per = bias.rotations.get(role) or []
        if len(per) != n_layers:
            raise ValueError(f"the set has {len(per)} {role.upper()} rotations for {n_layers} layers")
        for il, t in enumerate(per):
            a = torch.as_tensor(t).detach().to(torch.float32).cpu().contiguous().numpy()
            if a.ndim != 3 or a.shape[1] != a.shape[2] or not np.isfinite(a).all():
                raise ValueError(f"{rotation_name(il, role)}: expected a finite (H_kv, D, D) tensor, got shape {a.shape}")
            out[(il, role)] = a
    return out


# ----------------------------------------------------------------------------------------------
# Reading


_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType
_STRING, _ARRAY = 8, 9


def check_structure(data: bytes, where: str) -> None:
    """Walk a GGUF file's header, key/value and tensor-info sections and check that every declared
    count and length fits in the bytes there are (no value is decoded). ValueError if not.

    gguf-py's reader trusts these lengths: a forged array length makes it loop for hours, a forged
    count allocates without bound. This walk costs one pass over the (small) header.
    """
    n = len(data)
    pos = 0

    def take(size: int, what: str) -> int:
        nonlocal pos
        if size < 0 or pos + size > n:
            raise ValueError(
                f"{where}: not a readable GGUF file (truncated or malformed: {what} at byte {pos} runs past the end of its {n} bytes)"
            )
        start, pos = pos, pos + size
        return start

    def u32() -> int:
        return struct.unpack_from("<I", data, take(4, "a u32"))[0]

    def u64() -> int:
        return struct.unpack_from("<Q", data, take(8, "a u64"))[0]

    def string(what: str) -> None:
        length = u64()
        take(length, f"{what} of {length} bytes")

    def value(vtype: int, depth: int = 0) -> None:
        if vtype == _STRING:
            string("a string value")
        elif vtype == _ARRAY:
            if depth > 2:
                raise ValueError(
                    f"{where}: not a readable GGUF file (malformed: arrays nested deeper than 2)"
                )
            item = u32()
            count = u64()
            if item in _VALUE_SIZES:
                take(count * _VALUE_SIZES[item], f"an array of {count} items")
            elif item in (_STRING, _ARRAY):
                if count > n - pos:  # every item takes at least one byte
                    raise ValueError(
                        f"{where}: not a readable GGUF file (malformed: an array of {count} items in {n - pos} bytes)"
                    )
                for _ in range(count):
                    value(item, depth + 1)
            else:
                raise ValueError(f"{where}: not a readable GGUF file (malformed: array item type {item})")
        elif vtype in _VALUE_SIZES:
            take(_VALUE_SIZES[vtype], "a value")
        else:
            raise ValueError(f"{where}: not a readable GGUF file (malformed: value type {vtype})")

    if n < 24 or data[:4] != b"GGUF":
        raise ValueError(
            f"{where}: not a readable GGUF file ({f'{n} bytes, too short' if n < 24 else 'no GGUF magic'})"
        )
    pos = 4
    version = u32()
    if version not in (2, 3):
        raise ValueError(
            f"{where}: not a readable GGUF file (version {version}, expected 2 or 3; big-endian files are not read)"
        )
    n_tensors, n_kv = u64(), u64()
    if n_tensors > n // 24 or n_kv > n // 13:  # a tensor info takes >= 24 bytes, a key/value >= 13
        raise ValueError(
            f"{where}: not a readable GGUF file (malformed: {n_tensors} tensors, {n_kv} keys in {n} bytes)"
        )
    for _ in range(n_kv):
        string("a key")
        value(u32())
    for _ in range(n_tensors):
        string("a tensor name")
        n_dims = u32()
        if n_dims > 4:
            raise ValueError(
                f"{where}: not a readable GGUF file (malformed: a tensor with {n_dims} dimensions)"
            )
        take(8 * n_dims + 4 + 8, "a tensor info")


def read_file(path: str | os.PathLike) -> tuple[dict[int, np.ndarray], dict, dict[str, dict[int, np.ndarray]]]:
    """:func:`read_layers`, and the fitted rotations: ``{"k": {layer: (H, D, D) float32}, "v": {...}}`` (empty
    for a schema-1 file)."""
    return _read(os.fspath(path))


def read_layers(path: str | os.PathLike) -> tuple[dict[int, np.ndarray], dict]:
    """Layer index -> float32 array (numpy order, 1-D or ``(H_kv, D)``) and the BiasSet metadata
    (:meth:`~kvslim.calibration.biasset.BiasSet.metadata`'s keys; ``k_rot`` None when the file has none,
    ``architecture`` the file's ``general.architecture`` if any).

    Raises FileNotFoundError for a missing file and ValueError (one line, naming the file) for
    anything else wrong: not a GGUF file, truncated, a declared length past the end, not a schema-1
    kv-mean-center file, a key of the wrong type or an impossible value (an unknown channel order,
    a negative count, a malformed hash), a tensor that is not an F32 ``kv_bar.blk.<il>.k`` of 1 or
    2 dimensions, a non-canonical (``kv_bar.blk.01.k``) or duplicate name. Layers are returned as
    found (a gap or a count that does not fit the model is the caller's to judge). A schema-2 file's fitted
    rotations are checked too (:func:`read_file` returns them).
    """
    layers, meta, _ = _read(os.fspath(path))
    return layers, meta


def _read(path: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"bias file {path!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"bias file {path}: is a directory")
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise ValueError(f"{path}: {size} bytes, too large for a bias file (at most {MAX_FILE_BYTES})")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    check_structure(data, path)
    try:
        return _parse(path)
    except ValueError as e:
        first = str(e).strip().splitlines()
        message = first[0] if first else "malformed"
        raise ValueError(message if message.startswith(path) else f"{path}: {message}") from None
    except Exception as e:  # the reader raises KeyError, IndexError, struct.error, ... on bad input
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _parse(path: str) -> tuple[dict[int, np.ndarray], dict, dict]:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError, ...
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None

    def value(key, expected: tuple):
        f = reader.get_field(key)
        if f is None:
            return None
        if not f.types or f.types[0] not in expected or len(f.types) != 1:
            got = f.types[0].name if f.types else "empty"
            raise ValueError(
                f"{path}: {key} has type {got}, expected {' or '.join(t.name for t in expected)}"
            )
        return f.contents()

    ints = (
        GGUFValueType.UINT8, GGUFValueType.UINT16, GGUFValueType.UINT32, GGUFValueType.UINT64,
        GGUFValueType.INT8, GGUFValueType.INT16, GGUFValueType.INT32, GGUFValueType.INT64,
    )  # fmt: skip
    strings = (GGUFValueType.STRING,)
    ftype = value("general.type", strings)
    if ftype != FILE_TYPE:
        raise ValueError(
            f"{path}: general.type is {ftype!r}, expected {FILE_TYPE!r} (not a K mean-centering file)"
        )
    version = value(KEY_PREFIX + "schema_version", ints)
    # The fork's own writer records no schema version (a later fork adds it, = 1): absent is schema 1.
    if version is not None and int(version) not in (SCHEMA_VERSION, SCHEMA_VERSION_ROTATION):
        raise ValueError(
            f"{path}: kv_mean_center.schema_version is {int(version)}, this kvslim reads "
            f"{SCHEMA_VERSION} and {SCHEMA_VERSION_ROTATION}"
        )
    schema = SCHEMA_VERSION if version is None else int(version)
    k_rot = value(KEY_PREFIX + "k_rot", (GGUFValueType.BOOL,))
    pre_rope = value(KEY_PREFIX + "k_pre_rope", (GGUFValueType.BOOL,))
    meta = {
        "k_rot": None if k_rot is None else bool(k_rot),
        "pre_rope": None if pre_rope is None else bool(pre_rope),
        "model_fingerprint": None,
        "cache_type": value(KEY_PREFIX + "cache_type", strings),
        "channel_order": value(KEY_PREFIX + "channel_order", strings),
        "n_tokens": value(KEY_PREFIX + "n_tokens", ints),
        "text_sha256": value(KEY_PREFIX + "text_sha256", strings),
        "ctx": value(KEY_PREFIX + "ctx", ints),
        "n_chunks": value(KEY_PREFIX + "n_chunks", ints),
        "architecture": value("general.architecture", strings) or None,
        "rotation": value(KEY_PREFIX + "rotation", strings),
    }
    if meta["channel_order"] is not None and meta["channel_order"] not in CHANNEL_ORDERS:
        raise ValueError(
            f"{path}: kv_mean_center.channel_order is {meta['channel_order']!r}, expected one of "
            f"{', '.join(CHANNEL_ORDERS)}"
        )
    if meta["text_sha256"] is not None and not _HEX64.match(meta["text_sha256"]):
        raise ValueError(f"{path}: kv_mean_center.text_sha256 is not 64 lowercase hex digits")
    # model_sha256 is kvslim's fingerprint only when the file says so; the fork stores a hash of
    # the model's GGUF file bytes there, which kvslim cannot recompute from a loaded model.
    sha = value(KEY_PREFIX + "model_sha256", strings)
    kind = value(KEY_PREFIX + "model_sha256_kind", strings)
    if kind == FINGERPRINT_KIND:
        if not sha or not _HEX64.match(sha.lower()):
            raise ValueError(f"{path}: kv_mean_center.model_sha256 is not kvslim's 64 hex digit fingerprint")
        meta["model_fingerprint"] = "sha256:" + sha.lower()
    for key in ("n_tokens", "ctx", "n_chunks"):
        if meta[key] is not None:
            meta[key] = int(meta[key])
            if meta[key] < 0:
                raise ValueError(f"{path}: kv_mean_center.{key} is {meta[key]}, expected >= 0")
    layers: dict[int, np.ndarray] = {}
    rotations: dict[str, dict[int, np.ndarray]] = {}
    for t in reader.tensors:
        r = _ROT_RE.match(t.name)
        if r is not None:
            il, role = int(r.group(1)), r.group(2)
            if schema < SCHEMA_VERSION_ROTATION:
                raise ValueError(f"{path}: {t.name} in a schema-{schema} file (fitted rotations are schema 2)")
            if il in rotations.setdefault(role, {}):
                raise ValueError(f"{path}: {t.name} appears twice")
            if t.tensor_type != GGMLQuantizationType.F32 or len(t.shape) != 3:
                raise ValueError(
                    f"{path}: {t.name} has type {t.tensor_type.name} and {len(t.shape)} dimensions, expected F32 "
                    f"ne=[D, D, H_kv]"
                )
            a = np.array(t.data, dtype=np.float32, copy=True)
            if a.ndim != 3 or a.shape[1] != a.shape[2]:
                raise ValueError(f"{path}: {t.name} has shape {a.shape}, expected (H_kv, D, D)")
            rotations[role][il] = a
            continue
        m = _TENSOR_RE.match(t.name)
        if m is None:
            if _TENSOR_LIKE.match(t.name):
                raise ValueError(
                    f"{path}: tensor name {t.name!r} is not canonical; layer il is named "
                    f"kv_bar.blk.<il>.k (kv_rot.blk.<il>.k/v) with il written without leading zeros"
                )
            raise ValueError(
                f"{path}: unexpected tensor {t.name!r}; a bias file holds only kv_bar.blk.<il>.k"
            )
        il = int(m.group(1))
        if il in layers:  # gguf-py refuses exact duplicates; this is the last line of defence
            raise ValueError(f"{path}: {t.name} appears twice")
        if t.tensor_type != GGMLQuantizationType.F32:
            raise ValueError(f"{path}: {t.name} has type {t.tensor_type.name}, expected F32")
        if len(t.shape) > 2:
            raise ValueError(
                f"{path}: {t.name} has {len(t.shape)} dimensions (ne={list(map(int, t.shape))}), "
                f"expected 1 (ne=[D*H_kv]) or 2 (ne=[D, H_kv])"
            )
        # reader.tensors' data is numpy order (ne reversed): ne=[D, H] -> (H, D). Copy off the memmap.
        layers[il] = np.array(t.data, dtype=np.float32, copy=True)
    if not layers:
        raise ValueError(f"{path}: no kv_bar.blk.<il>.k tensors")
    if rotations and meta["rotation"] is None:
        raise ValueError(f"{path}: kv_rot tensors without kv_mean_center.rotation (the method they were fitted with)")
    return layers, meta, rotations


def read_bias_file(
    path: str | os.PathLike, *, n_kv_heads: int | None = None, head_dim: int | None = None
) -> BiasSet:
    """Read a bias file (kvslim's or the fork's). Tensors come back as stored: ``(H_kv, D)`` for
    2-D tensors, ``(H_kv * D,)`` for 1-D ones unless ``n_kv_heads`` and ``head_dim`` are given
    (then every tensor is validated and reshaped to ``(H_kv, D)``). Layers must be 0..n-1;
    a gap raises (use :func:`kvslim.calibration.meancenter.load_mean_center` for validation against a model)."""
    layers, meta, rot = read_file(path)
    missing = sorted(set(range(max(layers) + 1)) - set(layers))
    if missing:
        raise ValueError(
            f"{os.fspath(path)}: {tensor_name(missing[0])} missing; the file's layers are "
            f"{sorted(layers)} (not 0..{max(layers)})"
        )
    tensors = [torch.from_numpy(layers[il]) for il in range(len(layers))]
    if n_kv_heads is not None or head_dim is not None:
        if n_kv_heads is None or head_dim is None:
            raise ValueError("give both n_kv_heads and head_dim, or neither")
        tensors = [
            check_layer(t, il, n_kv_heads, head_dim, where=os.fspath(path)) for il, t in enumerate(tensors)
        ]
    rotations = None
    if rot:
        rotations = {}
        for role in ROLES:
            per = rot.get(role, {})
            if sorted(per) != list(range(len(tensors))):
                raise ValueError(
                    f"{os.fspath(path)}: the {role.upper()} rotations cover layers {sorted(per)}, the biases "
                    f"0..{len(tensors) - 1}"
                )
            rotations[role] = [torch.from_numpy(per[il]) for il in range(len(tensors))]
    return BiasSet(
        tensors=tensors,
        rotations=rotations,
        **{**meta, "k_rot": bool(meta["k_rot"]), "pre_rope": bool(meta["pre_rope"])},
    )
