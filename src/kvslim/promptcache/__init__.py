"""Prompt cache files: a :class:`~kvslim.SlimCache` saved as it is and loaded back, bit for bit.

A file holds every layer's compressed state exactly as stored — sinks, each stream's encoded token and
group parts (codes, scales, zeros, the per-token ``centered`` flags), the full-precision residual, the
positions bookkeeping (``seen``, ``runs``, ``sink_rot``, ``pads``, ``sink_start``, the base) — so nothing
is decoded or re-quantized, and a restored cache continues with exactly the logits of the saved one.
As llama.cpp's ``--prompt-cache`` and ``mlx_lm.cache_prompt`` do, the file may carry the token ids the
cache was filled with, so a caller can check that a new prompt starts with them.

Layout: a safetensors file (sorted tensor names, no timestamps: the same cache gives the same bytes)
whose metadata key ``kvslim`` holds a JSON header::

    format, version          "kvslim-prompt-cache", FORMAT_VERSION (a newer file is refused)
    cache_config             CacheConfig.to_spec(): format, sink/window, group, residual, levers as asked
    levers                   what the cache resolved: rotate, pre_rope, positions, residual (tokens),
                             residual_dtype, varnorm (the normalized streams: "kv", "k", "v" or "none";
                             absent in older files), clip (the clipped streams, the same way), codebook (the
                             streams whose codes index a Lloyd-Max level table; absent: "none")
    mean_center              None, or {path, file_sha256, bias_sha256} (bias_sha256: of the per-layer tensors)
    model                    {fingerprint (kvslim.calibration.fingerprint.model_fingerprint, or None), model_type, n_layers,
                              n_kv_heads, k_head_dim, v_head_dim}
    padding                  {explicit}: the cache's left padding was handed over (tensor ``padding.pads``)
    layers                   per model layer: {kind: "kv" | "dummy", seen, base, runs, dtype, kv_shape, v_dim,
                              k_offset, v_offset}
    tokens                   (B, T) of tensor ``token_ids``, or None
    sha256                   over the rest of the header and every tensor's name, dtype, shape and bytes
                             (a damaged file is refused)

Tensors: ``layers.{i}.{sink_k,sink_v,sink_rot,pads,sink_start}``, ``layers.{i}.{k,v}.token.{part}``,
``layers.{i}.{k,v}.group.{part}``, ``layers.{i}.{k,v}.residual``.

The package, one job per module (this file only re-exports their public names):

- :mod:`.state` — a cache as ``(tensors, header)`` and back: :func:`to_state` (CPU copies and a JSON-able
  dict; what a server parks idle sessions with), :func:`from_state` (a fresh cache rebuilt for the caller's
  model with the caller's builder, checked, filled through each layer's own
  :meth:`~kvslim.cache.layer.SlimLayer.restore`), and :func:`save` / :func:`load` with the file;
- :mod:`.files` — the bytes on disk: :func:`write_state` (a temporary beside the target, checked, renamed),
  :func:`read_header`, the reads of tensors and token ids;
- :mod:`.header` — the header's schema (:func:`check_header`), the layout version, :func:`content_sha256`;
- :mod:`.continuation` — the one continuation rule, :func:`check_continuation` (the model, its dtype, the
  cache settings, the token prefix), on a :class:`SavedCache` read from a file (:meth:`SavedCache.read`) or
  from a cache in memory (:meth:`SavedCache.of`); used by ``kvslim sample --prompt-cache`` and by the
  server's sessions (:mod:`kvslim.engine.sessions`).

The cache is an argument everywhere (and ``load`` / ``from_state`` take the builder of a fresh one,
``new_cache=SlimCache.from_config``): nothing here imports the cache adapter, whose
:meth:`~kvslim.SlimCache.save` / :meth:`~kvslim.SlimCache.load` call this package. Layers with a recurrent
state (linear attention, SSM hybrids) are refused: their state is not stored in these files (yet). This
package knows nothing about tokenizers or generation (see :mod:`kvslim.cli.prompt_cache`).
"""

from __future__ import annotations

from .continuation import (
    CannotContinue,
    SavedCache,
    can_continue,
    check_cache_config,
    check_continuation,
    continued_prefix,
)
from .files import read_header, write_state
from .header import FORMAT, FORMAT_VERSION, META_KEY, check_header, content_sha256
from .state import CacheBuilder, Restored, SavableCache, from_state, load, save, to_state

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_KEY",
    "CacheBuilder",
    "CannotContinue",
    "Restored",
    "SavableCache",
    "SavedCache",
    "can_continue",
    "check_cache_config",
    "check_continuation",
    "check_header",
    "content_sha256",
    "continued_prefix",
    "from_state",
    "load",
    "read_header",
    "save",
    "to_state",
    "write_state",
]
