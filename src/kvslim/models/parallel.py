"""Loading a model tensor parallel: in a process started by ``torchrun``, its process group already joined
with :func:`kvslim.distributed.init_from_env`, a directory, a hub id or the embedded model's converted copy is
loaded with transformers' ``tp_plan="auto"``: each rank holds a block of the KV heads. The model is checked
first (:func:`kvslim.distributed.check_tensor_parallel`); a GGUF file, unpacked whole, is refused.
"""

from __future__ import annotations

import torch

from ..calibration.fingerprint import model_fingerprint
from .converted import _MARKER, _copy_problem, _read_marker, converted_dir
from .sources import _from_dir, _from_hub, _one_line, _quiet_progress


def _load_tensor_parallel(kind: str, where, dtype: torch.dtype, *, verify: bool, **kwargs):
    """``(model, tokenizer)`` sharded over the default process group's ranks (``load_model``'s
    ``tensor_parallel``): checked on its config before the weights load, then on the shards."""
    import torch.distributed as dist

    from .. import distributed

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
