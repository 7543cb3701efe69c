"""K mean-centering calibration and its files: measured once, written as GGUF, applied by the cache.

- :mod:`.calibrate` — the mean of the cached K per (layer, KV head, channel) over a text;
- :mod:`.biasset` — the bias as data (:class:`~.biasset.BiasSet`) and the checks of one;
- :mod:`.biasfile` — the GGUF bias file in the layout of the llama.cpp fork, deterministic bytes;
- :mod:`.channelorder` — llama.cpp's K channel order and the conversions to and from transformers';
- :mod:`.meancenter` — loading a bias file and handing it to a cache, validated against the model;
- :mod:`.fingerprint` — a model's weights fingerprinted, so files recognise the model they were made for.

Documented entry points, importable from here: :func:`collect_k_means`, :func:`write_bias_file`,
:func:`read_bias_file`, :func:`load_mean_center` (loaded on first use; importing this package is cheap).
"""

from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {
    "collect_k_means": ("kvslim.calibration.calibrate", "collect_k_means"),
    "write_bias_file": ("kvslim.calibration.biasfile", "write_bias_file"),
    "read_bias_file": ("kvslim.calibration.biasfile", "read_bias_file"),
    "load_mean_center": ("kvslim.calibration.meancenter", "load_mean_center"),
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
