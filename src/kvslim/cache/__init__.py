"""The cache core: which tokens are kept, how each layer stores them, and the glue to transformers.

- :mod:`.policy` — which positions a layer keeps (everything, or StreamingLLM's sinks + window);
- :mod:`.timebuffer`, :mod:`.stream`, :mod:`.basis` — storage along the time axis (a growing or capped
  buffer; one encoded K or V stream and its capacities; the basis an encoded body is stored in);
- :mod:`.layer` — one layer's store: a keep policy + a codec per stream + a full-precision residual, with
  :mod:`.frames` (the RoPE frame of every stored key), :mod:`.segments` (the frozen view attention reads)
  and :mod:`.layerstate` (its state as tensors, for the prompt-cache files);
- :mod:`.positions`, :mod:`.rotary` — the one owner of position ids, and moving a rotated key;
- :mod:`.hadamard`, :mod:`.levers` — the storage basis and the low-bit levers read from a model;
- :mod:`.adapter` — :class:`SlimCache`, the transformers ``Cache``; :mod:`.layer_adapter` its per-layer
  contract over the stores; :mod:`.build` its options resolved and its layers built; :mod:`.accounting` its
  bytes and report (the modules that import transformers' Cache API are :mod:`.adapter`,
  :mod:`.layer_adapter`, :mod:`.static_adapter` and :mod:`.ragged`, and no other module of kvslim but
  :mod:`kvslim.compat`);
- :mod:`.static`, :mod:`.static_adapter` — fixed-capacity stores for a compiled decode step;
- :mod:`.ragged` — many caches as one batch for the engine's decode step.

The formats (:mod:`kvslim.formats`) and kernels (:mod:`kvslim.kernels`) are below this package; the
decode loop (:mod:`kvslim.generate`), the engine and the server are above it. Importing this package
is cheap: the names below load their modules on first use.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {
    "SlimCache": ("kvslim.cache.adapter", "SlimCache"),
    "StaticSlimCache": ("kvslim.cache.static_adapter", "StaticSlimCache"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
