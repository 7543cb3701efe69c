"""``kvslim sample --prompt-cache FILE``: keep a prompt's compressed cache in a file, and continue from it.

No file: every prompt token but the last is prefilled into a new cache, saved with their ids (the last
token is fed by the generation, which needs its logits; llama.cpp re-evaluates it the same way). A file:
the one continuation rule (:func:`kvslim.promptcache.check_continuation`, the server's sessions ask the same
one) — first on the file's settings before the model loads (:func:`check_prompt_cache`), then on this
model, its dtype and the prompt (:func:`prompt_cache`) — and only then its tensors are read and the rest of
the prompt is fed. A refusal is one :class:`~kvslim.cli.common.UserError` line: the rule's reason and the
fix. This module holds no rule of its own; it knows flags, not file bytes (:mod:`kvslim.promptcache`).
"""

from __future__ import annotations

import argparse
import os

from .common import UserError, bias_cache_maker, check_output, distributed_run

#: What to do about a --prompt-cache file the continuation rule refuses, by CannotContinue.kind (the
#: "damaged" and "tokens" messages say it themselves).
_PROMPT_CACHE_FIX = {
    "model": "use the model it was saved from, or another --prompt-cache file",
    "dtype": "pass the --dtype it was saved with, or another --prompt-cache file",
    "settings": "pass the cache flags it was saved with, or another --prompt-cache file",
}


def refused(e) -> UserError:
    """A --prompt-cache file the continuation rule refuses: one line, the rule's reason and the fix."""
    fix = _PROMPT_CACHE_FIX.get(e.kind)
    return UserError(f"{e}: {fix}" if fix else str(e))


def check_prompt_cache(args: argparse.Namespace, cache_config):
    """Before the model loads: an existing --prompt-cache file must have been saved with these cache flags
    (its header and token ids are read; its tensors later), a new one must be writable. Returns the file's
    :class:`~kvslim.promptcache.SavedCache`, or None when it is to be created."""
    path = args.prompt_cache
    if path is None:
        return None
    if distributed_run():
        raise UserError(
            "--prompt-cache is not available under torchrun (each rank holds a part of the cache)"
        )
    if not os.path.exists(path):
        check_output("--prompt-cache", path)
        return None
    from .. import promptcache as pc

    try:
        saved = pc.SavedCache.read(path)
        pc.check_continuation(saved, cache_config=cache_config, where=f"--prompt-cache {path}")
    except pc.CannotContinue as e:
        raise refused(e) from None
    return saved


def prompt_cache(args, model, input_ids, cache_config, saved):
    """``(cache, tokens still to feed (1, n), report entry)`` for --prompt-cache FILE.

    No file: prefill every prompt token but the last into a new cache and save it with their ids (the last
    token is fed by the generation, which needs its logits; llama.cpp re-evaluates it the same way). A file:
    the continuation rule (:func:`kvslim.promptcache.check_continuation`: this model, its dtype, these cache
    flags, a prompt that starts with the file's tokens) before its tensors are read, then load it and feed
    only the rest."""
    import torch

    from .. import promptcache as pc
    from ..cache.adapter import SlimCache
    from ..calibration.fingerprint import model_fingerprint
    from ..generate import prefill

    path, n_prompt = args.prompt_cache, input_ids.shape[1]
    fingerprint = model_fingerprint(model)
    if saved is None:
        cache = bias_cache_maker(model, args)(cache_config)
        head = input_ids[:, :-1]  # (1, T - 1)
        if head.shape[1]:
            with torch.inference_mode():
                prefill(model, head, cache)
        cache.save(path, token_ids=head.cpu(), model_fingerprint=fingerprint)
        note = f"--prompt-cache {path}: saved the prompt's first {head.shape[1]} of {n_prompt} tokens"
        return (
            cache,
            input_ids[:, -1:],
            {"file": path, "reused_tokens": 0, "saved_tokens": head.shape[1], "note": note},
        )
    try:
        n = pc.check_continuation(
            saved,
            input_ids,
            cache_config=cache_config,
            model_fingerprint=fingerprint,
            dtype=model.dtype,
            where=f"--prompt-cache {path}",
        )
    except pc.CannotContinue as e:
        raise refused(e) from None
    restored = pc.load(
        path,
        config=model.config,
        new_cache=SlimCache.from_config,
        model_fingerprint=fingerprint,
        mean_center=args.kv_mean_center,
        device=model.device,
        cache_config=cache_config,
        allow_other_model=args.kv_mean_center_any_model,
    )  # ValueError (one line): the checks that need the tensors (checksum, shapes, levers, the bias)
    note = f"--prompt-cache {path}: reused {n} of the prompt's {n_prompt} tokens; prefilling {n_prompt - n}"
    return (
        restored.cache,
        input_ids[:, n:],
        {"file": path, "reused_tokens": n, "saved_tokens": 0, "note": note},
    )
