"""``load_model``: a model spec (:func:`kvslim.models.resolve_spec`) to ``(model, tokenizer)`` on a device, in
a dtype: each kind of source by its loader (:mod:`kvslim.models.sources`), the embedded model through its
converted copy (:mod:`kvslim.models.converted`), a sharded model by :mod:`kvslim.models.parallel`."""

from __future__ import annotations

import os

import torch

from .converted import _load_embedded
from .parallel import _load_tensor_parallel
from .sources import _from_dir, _from_gguf, _from_hub, _one_line, _quiet_progress, resolve_spec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    spec: str | os.PathLike | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
    verify: bool = False,
    tensor_parallel: bool = False,
):
    """Load ``(model, tokenizer)`` for ``spec`` (see :mod:`kvslim.models` and :func:`resolve_spec`),
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
        raise ValueError(
            "device 'meta' holds no weights, so the model could not run; expected e.g. 'cpu' or 'cuda'"
        )
    return parsed


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]
