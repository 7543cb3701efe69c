"""SlimCache under tensor parallelism: which KV heads a rank holds, a cache built for them, bytes summed.

transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` or
``distributed_config=DistributedConfig(tp_size=N)``, one process per device, started by ``torchrun``) shards
``k_proj`` / ``v_proj`` column-wise (``"colwise"``, a ``Shard(0)`` DTensor weight): rank ``r`` of ``N``
computes, and caches, a contiguous block of ``H_kv / N`` KV heads — the keys a rank's attention layer hands
its cache are ``(B, H_kv / N, T, D)``. Everything per head in kvslim needs nothing for that: the codecs,
the Hadamard rotation (within a head), RoPE and pre-RoPE storage (within a head), StreamingLLM (the
same tokens on every rank: positions do not depend on heads). What is full-width is the model config
a cache is built from, and the one tensor kvslim holds per KV head: the K mean-centering bias
``(H_kv, D)``, which must be cut to the rank's heads (a full-width bias is refused at the first
update: "bias has shape (4, 32) but the tokens have 2 KV heads"). :func:`rank_cache` builds the cache
for the rank's heads; :func:`reduce_nbytes` sums the bytes over the ranks (``nbytes()`` is one rank's).

A layer-split model (``device_map`` placing layers on several devices) needs nothing: each layer's
store is created from the keys it is handed, on their device.

Starting a run: :func:`init_from_env` joins the process group ``torchrun`` describes in the environment
(gloo on the CPU, NCCL on CUDA, a 60 s timeout so that a dead rank fails its peers within a minute instead of
transformers' two hours), :func:`check_tensor_parallel` refuses a model that cannot be split before it is
loaded, :func:`shared_seed` gives every rank the same sampling seed, :func:`agree` checks that the ranks
still hold the same value (the tokens they drew), :func:`shutdown` leaves the group.

What this module does not know: the model's files, the data (every rank feeds the same tokens; that is the
caller's business) or what is printed (the CLI prints on rank 0, :func:`is_main_process`). MLA models
(DeepSeek), whose cache holds a latent every rank replicates, and fused ``qkv_proj`` projections are not
covered: :func:`rank_kv_heads` refuses a sharded model whose key projection it cannot find.
"""

from __future__ import annotations

import copy
import os
import secrets
from datetime import timedelta

import torch

from .shapes import ModelShapes, is_mla, text_config

#: Seconds a rank waits for the others (to join, or in a collective) before it fails: long enough for a busy
#: machine's model load to drift between ranks, short enough that a dead rank does not hang its peers.
TIMEOUT_S = 60.0

#: torch.distributed backend per device type (what transformers picks too)
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def env_world_size() -> int:
    """``WORLD_SIZE`` from the environment ``torchrun`` sets (1 when unset): the processes of this run."""
    return _env_int("WORLD_SIZE", 1)


def env_rank() -> int:
    """``RANK`` from the environment ``torchrun`` sets (0 when unset)."""
    return _env_int("RANK", 0)


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} in the environment is not an integer (torchrun sets it)") from None


def init_from_env(device: str | torch.device = "cpu", *, timeout_s: float = TIMEOUT_S) -> torch.device:
    """Join the default process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``) and return this rank's device.

    Tensor-parallel loading puts each rank on the machine's accelerator (``cuda:LOCAL_RANK``; the CPU when
    torch has none), whatever device is asked for, so ``device`` must name that kind (``"cuda"`` or
    ``"cuda:N"`` on a CUDA machine, ``"cpu"`` otherwise): ValueError names the mismatch. Backend: gloo for
    the CPU, NCCL for CUDA. ``timeout_s`` bounds every wait (joining, each collective). A group already
    initialized (by the caller) is kept as it is.
    """
    dist = _dist()
    if dist is not None:
        return _rank_device()
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("this torch build has no torch.distributed: tensor parallelism is unavailable")
    want = torch.device(device)
    kind = _accelerator_type()
    if want.type != kind:
        where = "the CPU (torch sees no accelerator here)" if kind == "cpu" else f"{kind}:LOCAL_RANK"
        raise ValueError(
            f"device {str(want)!r}: transformers' tensor parallelism runs every rank on this machine's "
            f"accelerator, here {where}; ask for {kind!r}"
        )
    backend = _BACKENDS.get(kind)
    if backend is None:
        raise ValueError(
            f"no process-group backend known for {kind!r} devices (known: {', '.join(_BACKENDS)})"
        )
    world, rank, local = env_world_size(), env_rank(), _env_int("LOCAL_RANK", 0)
    kwargs = {}
    if kind == "cuda":
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)  # binds NCCL's communicator to this rank's GPU
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    return _rank_device()


def _accelerator_type() -> str:
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return "cpu" if accelerator is None else accelerator.type


def _rank_device() -> torch.device:
    kind = _accelerator_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def shutdown(*, wait: bool = True) -> None:
    """Leave the default process group (nothing when none is initialized). ``wait``: first a barrier, so that
    no rank tears gloo down while a peer still talks to it; pass False after a failure, when a peer may be
    gone and a barrier would wait out the timeout."""
    dist = _dist()
    if dist is None:
        return
    try:
        if wait:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def check_tensor_parallel(config, world: int) -> None:
    """ValueError (one line) unless transformers' tensor parallelism over ``world`` ranks gives each rank
    whole KV heads of a separate ``k_proj`` — what :func:`rank_kv_heads` reads after loading. Checked on the
    config, before the weights load: the model type has a tensor-parallel plan, the plan shards ``k_proj``
    (not a fused QKV projection), it is not MLA, and ``world`` divides both head counts."""
    text = text_config(config)
    shapes = ModelShapes.from_config(config)
    name = shapes.model_type
    if is_mla(text):
        raise ValueError(
            f"the {name} model caches a multi-head latent (MLA) every rank would replicate: kvslim does not run "
            f"it tensor parallel; run it in one process"
        )
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if not plan:
        raise ValueError(
            f"transformers has no tensor-parallel plan for {name} models: it cannot be split over {world} "
            f"ranks; run it in one process"
        )
    if not any(key.rsplit(".", 1)[-1] == "k_proj" for key in plan):
        raise ValueError(
            f"the {name} tensor-parallel plan has no separate k_proj (fused QKV: {', '.join(sorted(plan)[:2])}, "
            f"...): kvslim cannot tell which KV heads a rank holds; run it in one process"
        )
    for what, n in (("KV heads", shapes.n_kv_heads), ("query heads", shapes.n_heads)):
        if n % world:
            fits = [d for d in range(2, n + 1) if n % d == 0]
            raise ValueError(
                f"the model's {n} {what} do not split over {world} ranks: each rank must hold whole heads; "
                f"run with --nproc-per-node in {{{', '.join(map(str, fits))}}}"
                if fits
                else f"the model's {n} {what} do not split over {world} ranks; run it in one process"
            )


def shared_seed(seed: int | None) -> int | None:
    """The sampling seed every rank uses: ``seed`` when given (every rank got the same arguments); when None,
    one drawn on rank 0 and broadcast, so that the ranks sample the same tokens (fresh entropy on every rank
    would split them apart, and a rank that stops at an end-of-sequence token another did not draw leaves
    its peers waiting). Without a process group, ``seed`` as it is. Every rank must call it (a collective)."""
    dist = _dist()
    if seed is not None or dist is None:
        return seed
    value = torch.tensor([secrets.randbits(63) if dist.get_rank() == 0 else 0], dtype=torch.int64)
    value = value.to(_collective_device(None))
    dist.broadcast(value, src=0)
    return int(value.item())


def agree(value: int, *, group=None) -> bool:
    """Whether every rank of ``group`` holds the same ``value`` (an integer of at most 62 bits): one
    ``all_reduce`` of ``(value, -value)`` with MAX, so every rank gets the same answer. True without a
    process group. Every rank must call it (a collective)."""
    dist = _dist()
    if dist is None:
        return True
    both = torch.tensor([value, -value], dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = int(both[0]), -int(both[1])
    return high == low


def _collective_device(group) -> torch.device:
    """Where a collective's tensors must live: the current GPU for NCCL, the CPU otherwise."""
    if _dist().get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dist():
    """``torch.distributed`` when it is available and initialized, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def is_main_process() -> bool:
    """True on global rank 0, and in a process that is not part of a process group (print there only)."""
    dist = _dist()
    return dist is None or dist.get_rank() == 0


def _key_projection(model, rows: int):
    """The weight of the decoder's first ``k_proj`` with ``rows`` output rows (``H_kv * head_dim``, the
    global shape of a sharded one), or None. Searched in the text decoder (``get_decoder()``) so that a
    multimodal model's vision tower, which may have ``k_proj`` modules of its own, is not read instead."""
    root = model
    get_decoder = getattr(model, "get_decoder", None)  # every transformers model has one; a bare module not
    if callable(get_decoder):
        try:
            root = get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            root = model
    for name, module in root.named_modules():
        weight = getattr(module, "weight", None)
        if (
            name.rsplit(".", 1)[-1] == "k_proj"
            and isinstance(weight, torch.Tensor)
            and weight.shape[0] == rows
        ):
            return weight
    return None


def rank_kv_heads(model) -> range:
    """The KV heads (indices into the model's ``H_kv``) this process's attention layers hold.

    Read from the model itself, not re-derived from a plan: the first ``k_proj`` weight, when it is a
    DTensor sharded on its output rows (``Shard(0)``, transformers' ``"colwise"``), holds rows
    ``[c * ceil(R / n), ...)`` of ``R`` on mesh coordinate ``c`` of ``n`` (``torch.chunk``'s split, which
    DTensor uses); its rows over ``head_dim`` are the heads. Any other model (no TP, a replicated
    ``k_proj``, a layer-split model) holds every head: ``range(H_kv)``.

    Raises ValueError when the shard does not fall on whole heads, or when the model is tensor parallel
    (``model.tp_size > 1``) and has no ``k_proj`` to read (fused ``qkv_proj``, MLA).
    """
    shapes = ModelShapes.from_config(model.config)
    every = range(shapes.n_kv_heads)
    weight = _key_projection(model, shapes.n_kv_heads * shapes.k_head_dim)
    tp = getattr(model, "tp_size", None) or 1
    if weight is None or is_mla(text_config(model.config)):
        if tp > 1:
            raise ValueError(
                f"cannot tell which KV heads this rank holds: the {shapes.model_type} model is tensor parallel "
                f"(tp_size {tp}) but has no separate k_proj (fused QKV or MLA); kvslim.distributed serves "
                f"models with a k_proj"
            )
        return every
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return every
    dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0]
    if not dims:  # replicated (or sharded along its input): every rank computes every head
        return every
    mesh_dim = dims[0]
    n = weight.device_mesh.size(mesh_dim)
    coord = weight.device_mesh.get_local_rank(mesh_dim)
    rows, local = weight.shape[0], weight.to_local().shape[0]
    start = coord * -(-rows // n)  # torch.chunk: ceil(R / n) rows per rank, the last ones shorter
    d = shapes.k_head_dim
    if start % d or local % d:
        raise ValueError(
            f"k_proj's shard on this rank (rows {start}..{start + local} of {rows}) does not fall on whole "
            f"heads of head_dim {d} ({shapes.n_kv_heads} KV heads): choose a tp_size that divides {shapes.n_kv_heads}"
        )
    return range(start // d, (start + local) // d)


def rank_config(config, heads: range):
    """A copy of a model config describing one rank: ``len(heads)`` KV heads and the query heads that
    go with them, ``head_dim`` written out (a derived one would change with the head count). What a
    SlimCache for that rank checks its shapes against; the model's own config is left alone."""
    config = copy.deepcopy(config)
    text = text_config(config)
    shapes = ModelShapes.from_config(text)
    if shapes.n_heads % shapes.n_kv_heads:
        raise ValueError(f"{shapes.n_heads} query heads do not split over {shapes.n_kv_heads} KV heads")
    text.head_dim = shapes.head_dim
    text.num_key_value_heads = len(heads)
    text.num_attention_heads = len(heads) * (shapes.n_heads // shapes.n_kv_heads)
    return config


def shard_bias(
    mean_center,
    config,
    heads: range,
    *,
    model_fingerprint: str | None = None,
    allow_other_model: bool = False,
):
    """A K mean-centering bias cut to ``heads``, as a :class:`~kvslim.calibration.meancenter.BiasSet` a rank's
    SlimCache takes.

    ``mean_center`` is what SlimCache takes (a bias file path, a BiasSet, per-layer ``(H_kv, D)`` tensors),
    full width, for the model of ``config``. It is validated against the whole model first (shapes, the
    fingerprint, llama.cpp's channel order converted), then every layer's ``(H_kv, D)`` is sliced to
    ``(len(heads), D)``; the basis it records (``k_rot``, ``pre_rope``) is kept, so the cache resolves
    ``rotate``/``pre_rope`` as it would for the file. Fitted rotations (schema 2, ``rotate='fitted'``), one
    ``(H_kv, D, D)`` per layer and role, are checked the same way and sliced to ``(len(heads), D, D)``: a rotation
    acts within a head, so a rank's heads need only their own matrices.
    """
    from .calibration.biasfile import read_layers
    from .calibration.meancenter import BiasSet, load_mean_center

    if isinstance(mean_center, (str, os.PathLike)):
        meta = read_layers(mean_center)[1]
    elif isinstance(mean_center, BiasSet):
        meta = mean_center.metadata()
    else:
        meta = {}
    shapes = ModelShapes.from_config(config)
    k_rot, pre_rope = bool(meta.get("k_rot")), bool(meta.get("pre_rope"))
    full = load_mean_center(
        mean_center,
        n_layers=shapes.n_layers,
        n_kv_heads=shapes.n_kv_heads,
        head_dim=shapes.head_dim,
        model_fingerprint=model_fingerprint,
        allow_other_model=allow_other_model,
        model_type=shapes.model_type,
        k_rot=k_rot,
        pre_rope=pre_rope,
    )  # n_layers x (H_kv, D), transformers' channel order
    rotations = None
    if (mean_center.rotations if isinstance(mean_center, BiasSet) else meta.get("rotation")):
        from .calibration.rotation import load_rotations

        loaded, _ = load_rotations(
            mean_center,
            n_layers=shapes.n_layers,
            n_kv_heads=shapes.n_kv_heads,
            head_dim=shapes.k_head_dim,
            v_head_dim=shapes.v_head_dim,
        )  # {"k", "v"} -> one (H_kv, D, D) per layer, checked orthogonal
        rotations = {
            role: [r.matrix[heads.start : heads.stop].contiguous() for r in layers.layers]  # (len(heads), D, D)
            for role, layers in loaded.items()
        }
    return BiasSet(
        [t[heads.start : heads.stop].contiguous() for t in full],  # (len(heads), D) each
        k_rot=k_rot,
        pre_rope=pre_rope,
        cache_type=meta.get("cache_type"),
        n_tokens=meta.get("n_tokens"),
        text_sha256=meta.get("text_sha256"),
        ctx=meta.get("ctx"),
        n_chunks=meta.get("n_chunks"),
        rotations=rotations,
        rotation=meta.get("rotation") if rotations else None,
    )


def rank_cache(model, **kwargs):
    """A :class:`~kvslim.SlimCache` for the KV heads this process's layers hold (:func:`rank_kv_heads`).

    ``kwargs`` are SlimCache's (``kv_quantize``, ``sink``, ``window``, ``mean_center``, ...); ``config`` is
    taken from ``model``. Unsharded, this is ``SlimCache(config=model.config, **kwargs)``. Sharded, the
    cache is checked against the rank's shapes (:func:`rank_config`) and a ``mean_center`` bias — given
    full width, the same on every rank — is cut to the rank's heads (:func:`shard_bias`).
    """
    from .cache.adapter import SlimCache

    if "config" in kwargs:
        raise ValueError("rank_cache takes the config from the model; do not pass config=")
    heads = rank_kv_heads(model)
    full = ModelShapes.from_config(model.config).n_kv_heads
    if len(heads) == full:
        return SlimCache(config=model.config, **kwargs)
    if kwargs.get("mean_center") is not None:
        kwargs["mean_center"] = shard_bias(
            kwargs["mean_center"],
            model.config,
            heads,
            model_fingerprint=kwargs.pop("model_fingerprint", None),
            allow_other_model=kwargs.pop("allow_other_model", False),
        )
    return SlimCache(config=rank_config(model.config, heads), **kwargs)


def reduce_nbytes(cache, *, live: bool = False, group=None) -> int:
    """``cache.nbytes()`` (``live=True``: ``live_nbytes()``) summed over the processes of ``group`` (None:
    all of them) with ``all_reduce``; this process's own value when no process group is initialized.

    Every rank must call it (a collective). Under tensor parallelism the ranks hold disjoint KV heads, so
    the sum is the model's whole cache. ``nbytes()`` also counts what every rank holds a copy of (the RoPE
    frequencies, the per-row padding and sink positions), so its sum exceeds one process's by
    ``(ranks - 1)`` copies (96 bytes for the tests' 2-layer model); ``live_nbytes()`` counts the stored
    tokens only and sums exactly to one process's. With data parallel replicas, pass the
    tensor-parallel group, or the replicas are summed too.
    """
    (total,) = reduce_ints([cache.live_nbytes() if live else cache.nbytes()], group=group)
    return total


def reduce_ints(values: list[int], *, group=None) -> list[int]:
    """``values`` summed element-wise over the processes of ``group`` (one ``all_reduce``); ``values`` as they
    are when no process group is initialized. Every rank must call it with as many values."""
    dist = _dist()
    if dist is None:
        return list(values)
    total = torch.tensor(values, dtype=torch.int64, device=_collective_device(group))
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return [int(v) for v in total.tolist()]


def reduce_report(report: dict, *, group=None) -> dict:
    """A :meth:`~kvslim.SlimCache.report` with its byte counts summed over the ranks of ``group``: the whole
    model's cache (``cache_bytes``, ``live_bytes``, ``fp16_full_cache_bytes``, every ``components`` and
    ``layer_types`` byte count), the fp16 ratio recomputed, and ``"ranks"`` added. Token counts and the
    config are every rank's alike and kept. Every rank must call it (one collective); without a process
    group the report is returned as it is."""
    dist = _dist()
    if dist is None:
        return report
    out = copy.deepcopy(report)
    top = ["cache_bytes", "live_bytes", "fp16_full_cache_bytes"]
    parts = sorted(out.get("components") or {})
    kinds = sorted(out.get("layer_types") or {})
    values = [int(out[k] or 0) for k in top]
    values += [int(out["components"][k]) for k in parts]
    values += [int(out["layer_types"][k]["bytes"]) for k in kinds]
    summed = iter(reduce_ints(values, group=group))
    for k in top:
        out[k] = next(summed)
    for k in parts:
        out["components"][k] = next(summed)
    for k in kinds:
        out["layer_types"][k]["bytes"] = next(summed)
    fp16 = out["fp16_full_cache_bytes"]
    out["ratio_to_fp16_full"] = out["cache_bytes"] / fp16 if fp16 else None
    out["ranks"] = dist.get_world_size(group)
    return out
