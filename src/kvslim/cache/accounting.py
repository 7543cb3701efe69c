"""Byte accounting of a SlimCache: what it holds, what it will hold, and the report.

:class:`CacheAccounting` is the accounting half of :class:`~kvslim.SlimCache` (a base class of it): ``nbytes``
counts every tensor the cache holds — codes, scales, zeros, residual, sinks, biases, fitted rotation matrices,
per-row bookkeeping, buffer slack included — from the stores' own tensors; ``projected_nbytes`` is the most a cache will hold for a
given number of tokens (the batch engine's budget); ``report`` the summary the CLI and benchmarks print.

It reads the cache through a small surface: ``stores()`` and ``layers`` (the per-layer stores and
transformers' layers), ``policy``, ``cache_config``, ``rotary``, ``rebase_period``, ``get_seq_length()`` and
the resolved options (``positions``, ``rotate``, ``pre_rope``, ``_codecs``, ``_shapes``, ``_rope_source``,
``_hadamard``).
This module knows nothing about how those were configured, nor about attention or files.
"""

from __future__ import annotations

import torch

from ..compat import DummyLayer, LinearAttentionCacheLayerMixin  # by release: see compat
from .layer_adapter import SlimCacheLayer


class CacheAccounting:
    """Bytes held and projected, per component and per layer type, and :meth:`report` (module docstring)."""

    def nbytes(self) -> int:
        """Every byte the cache holds: codes, scales, zeros, residual, sinks, biases, fitted rotation matrices
        (:meth:`rotation_nbytes`: once per cache), bookkeeping (buffer slack included)."""
        return sum(self.components().values())

    def projected_nbytes(self, tokens: int, *, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """The most bytes this cache will hold while fed ``tokens`` tokens per row (a prompt, then one per
        step) for ``batch`` rows of a model computing in ``dtype``: an upper bound to reserve up front (the
        batch engine's memory budget). A bounded cache reaches it once full and never exceeds it. Needs
        ``config`` (the KV shapes); linear-attention states are not projected (ValueError)."""
        if self._shapes is None:
            raise ValueError("projected_nbytes needs a cache built with config=model.config (the KV shapes)")
        if any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in self.layers):
            raise ValueError("projected_nbytes cannot project linear-attention states (this model has some)")
        shapes = self._shapes
        kv = (batch, shapes.n_kv_heads, shapes.k_head_dim)
        held = sum(s.projected_nbytes(tokens, kv, shapes.v_head_dim, dtype) for s in self.stores())
        rotary = self._rotary_nbytes()
        if self._rope_source is not None:  # pre-RoPE's angle table over the positions read (Rotary.table)
            span = (
                tokens
                if self.rebase_period is None
                else min(tokens, self.rebase_period + self.policy.capacity)
            )
            half = self._rope_source.rotary.inv_freq.numel()
            rotary += (span + max(64, span // 4) + 1) * half * 4 * 2  # cos and sin, float32
        return held + rotary + self.rotation_nbytes()

    def kept_nbytes(self) -> int:
        """Bytes of the decoded bodies kept while :meth:`~kvslim.SlimCache.keep_decoded` is on (not in :meth:`nbytes`:
        they are a prompt's working copy, not storage)."""
        return sum(s.k.kept_nbytes() + s.v.kept_nbytes() for s in self.stores())

    def projected_kept_nbytes(self, tokens: int, *, batch: int = 1, dtype: torch.dtype = torch.float32) -> int:
        """The most bytes :meth:`kept_nbytes` reaches over a prompt of ``tokens`` tokens per row (every token in the
        body: an upper bound), for ``batch`` rows of a model computing in ``dtype``. Needs ``config``."""
        if self._shapes is None:
            raise ValueError("projected_kept_nbytes needs a cache built with config=model.config (the KV shapes)")
        shapes = self._shapes
        k = (batch, shapes.n_kv_heads, shapes.k_head_dim)
        v = (batch, shapes.n_kv_heads, shapes.v_head_dim)
        return sum(
            s.k.projected_kept_nbytes(tokens, k, dtype) + s.v.projected_kept_nbytes(tokens, v, dtype)
            for s in self.stores()
        )

    def live_nbytes(self) -> int:
        """Bytes of the stored tokens alone, without preallocated buffer slack."""
        return sum(s.live_nbytes() for s in self.stores())

    def stored_tokens(self) -> int:
        """Tokens held now by a full-attention layer (every one holds the same number: they see the same
        tokens and share the policy; sliding layers hold at most the model's window)."""
        kv = [layer for layer in self.layers if isinstance(layer, SlimCacheLayer)]
        full = [layer for layer in kv if not layer.is_sliding] or kv
        return full[0].store.stored if full else 0

    def components(self) -> dict[str, int]:
        """Bytes per kind of tensor, summed over layers (``rotary``: the RoPE frequencies, held once;
        ``rotation``: the fitted rotation matrices, :meth:`rotation_nbytes`)."""
        out: dict[str, int] = {}
        for s in self.stores():
            for name, n in s.components().items():
                out[name] = out.get(name, 0) + n
        out["linear_state"] = sum(_linear_state_bytes(layer) for layer in self.layers)
        out["rotary"] = self._rotary_nbytes()
        out["rotation"] = self.rotation_nbytes()
        return out

    def rotation_nbytes(self) -> int:
        """The fitted rotation matrices (``rotate='fitted'``, :mod:`kvslim.calibration.rotation`; 0 otherwise):
        one float32 ``(H_kv, D, D)`` per layer and encoded role, all layers' (the cache holds them from
        construction, kept layers included), plus the copy a rotation makes on each other device it served
        (CUDA). A fixed cost per cache, not per token: 2 x 30 layers x 3 KV heads x 64^2 x 4 B = 2.9 MB for
        SmolLM2-135M.

        Counted once per cache, each distinct tensor once. Caches built from one
        :class:`~kvslim.calibration.biasset.BiasSet` — the batch engine reads its bias file once
        (:mod:`kvslim.engine.gate`) and builds every row's cache from it — hold the very same CPU tensors:
        each cache's ``nbytes()`` counts them (what it keeps alive), so a sum over such caches counts the shared
        matrices once per cache, not once per process (an upper bound; a Hadamard basis is module-level and
        counted by none)."""
        from ..calibration.rotation import LayerRotations, held_nbytes

        rotations = [r for r in self._hadamard.values() if isinstance(r, LayerRotations)]
        return held_nbytes(t for r in rotations for t in r.tensors())

    def _rotary_nbytes(self) -> int:
        """The RoPE frequencies (+ pre-RoPE's angle table), each held once; the Hadamard block matrices are
        module-level, shared by every cache (kvslim.cache.hadamard: 4 * block^2 bytes per block size, 16 KiB for 64),
        not held here."""
        rotaries = {
            id(r): r for r in (self.rotary, getattr(self._rope_source, "rotary", None)) if r is not None
        }
        return sum(r.nbytes() for r in rotaries.values())

    def layer_type_bytes(self) -> dict[str, dict[str, int]]:
        """Per transformers layer type: how many layers, how many hold K/V, and their bytes (the depth axis:
        KV-sharing layers hold nothing, linear-attention layers only their recurrent state)."""
        out: dict[str, dict[str, int]] = {}
        for layer in self.layers:
            kind = getattr(layer, "layer_type", None) or _layer_kind(layer)
            row = out.setdefault(kind, {"layers": 0, "kv_layers": 0, "bytes": 0})
            row["layers"] += 1
            if isinstance(layer, SlimCacheLayer):
                row["kv_layers"] += 1
                row["bytes"] += layer.store.nbytes()
            row["bytes"] += _linear_state_bytes(layer)
        return out

    def fp16_full_cache_bytes(self, tokens: int | None = None) -> int:
        """Bytes an fp16 cache without eviction would need for ``tokens`` (default: tokens seen)."""
        tokens = self.get_seq_length() if tokens is None else tokens
        total = 0
        for s in self.stores():
            if s.kv_shape is not None:
                batch, heads, k_dim = s.kv_shape
                total += batch * heads * tokens * (k_dim + s.v_dim) * 2  # K and V, 2 bytes each
        return total

    def report(self) -> dict:
        """Tokens seen and stored, bytes held (total and per component), and the fp16 full-cache bytes."""
        seen = self.get_seq_length()
        fp16 = self.fp16_full_cache_bytes(seen)
        nbytes = self.nbytes()
        return {
            "tokens_seen": seen,
            "tokens_stored": self.stored_tokens(),
            "capacity": self.policy.capacity,
            "cache_bytes": nbytes,
            "live_bytes": self.live_nbytes(),
            "fp16_full_cache_bytes": fp16,
            "ratio_to_fp16_full": (nbytes / fp16) if fp16 else None,
            "components": self.components(),
            "layer_types": self.layer_type_bytes(),
            "kv_layers": len(self.stores()),
            "layers": len(self.layers),
            "config": self.cache_config.to_dict(),
            "positions": self.positions,
            "rotate": self.rotate,
            "pre_rope": self.pre_rope,
            "varnorm": "".join(r for r in "kv" if getattr(self._codecs[r], "varnorm", False)) or "none",
            "clip": "".join(r for r in "kv" if getattr(self._codecs[r], "clip", False)) or "none",
            "codebook": "".join(r for r in "kv" if getattr(self._codecs[r], "levels", None)) or "none",
            "residual": self.cache_config.residual_tokens,
            "sink": self.cache_config.sink_tokens,
        }


def _linear_state_bytes(layer) -> int:
    """Bytes of a linear-attention layer's conv and recurrent states (0 for other layers)."""
    if not isinstance(layer, LinearAttentionCacheLayerMixin):
        return 0
    tensors = [*layer.conv_states.values(), *layer.recurrent_states.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _layer_kind(layer) -> str:
    if isinstance(layer, DummyLayer):
        return "dummy"
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return "linear_attention"
    return type(layer).__name__
