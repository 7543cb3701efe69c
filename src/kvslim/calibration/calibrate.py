"""K mean-centering calibration: the mean of the cached K per (layer, kv-head, channel) over a text.

What is measured is exactly the tensor the cache stores: the post-RoPE ``key_states`` every
attention layer hands to ``Cache.update``, seen through :class:`~kvslim.SlimCache`'s ``observe=``
hook on an uncompressed cache (``kv_quantize="none"``), so attention inside a chunk is exact and no
model-specific hook is needed. For a cache that stores K in another basis (``rotate`` with K: Hadamard-
rotated; ``pre_rope``: before RoPE) the hook is asked for the keys in that basis
(``observe_stored=True``): the layer transforms them with the same code that stores them, and the
result records the basis (``k_rot``, ``pre_rope``). Every forward goes through :func:`kvslim.generate.prefill`. As in
llama.cpp's ``tools/kv-mean-center`` (PrismML-Eng/llama.cpp PR #51), the text is run in independent
chunks of ``ctx`` tokens, a fresh cache per chunk, so positions restart at 0 in every chunk; sums
are float64.

With ``fit_rotation=True`` the same pass also sums the channel moments of K (in the file's basis) and V per
(layer, KV head) and fits the rotation of :mod:`kvslim.calibration.rotation` to them (schema 2 of the file).

This module only measures. The result is a :class:`~kvslim.calibration.meancenter.BiasSet` (what a bias is,
and how a cache loads one); :mod:`kvslim.calibration.biasfile` writes and reads it as GGUF; the cache layer
subtracts it.
"""

from __future__ import annotations

import hashlib
import warnings

import torch

from ..generate import prefill
from ..shapes import ModelShapes
from .fingerprint import model_fingerprint
from .meancenter import BiasSet, KStats, check_positive_int
from .rotation import METHOD as ROTATION_METHOD

#: Fewest calibration tokens for a useful bias: one chunk of llama.cpp's default context (the fork's
#: tool refuses less). docs/mean-center.md's measured gains used 7168 tokens.
MIN_USEFUL_TOKENS = 512


def standard_error_ratio(bias: torch.Tensor, std: torch.Tensor, n_tokens: int) -> float:
    """How noisy one layer's bias estimate is: the standard error of the mean,
    ``sqrt(sum(std^2) / n)``, over ``|bias|`` (both over the whole ``(H_kv, D)`` layer)."""
    norm = float(bias.double().norm())
    se = float((std.double() ** 2).sum().sqrt()) / max(n_tokens, 1) ** 0.5
    return se / norm if norm > 0 else float("inf")


class _KSums:
    """float64 running sums per layer: sum and sum of squares of K per (head, channel), sum of K
    row norms per head, and the token count."""

    def __init__(self):
        self.sum: dict[int, torch.Tensor] = {}
        self.sumsq: dict[int, torch.Tensor] = {}
        self.norm: dict[int, torch.Tensor] = {}
        self.count: dict[int, int] = {}

    def add(self, layer: int, keys: torch.Tensor) -> None:
        """keys: ``(B, H_kv, T, D)``, unpadded (every row is a real token)."""
        k = keys.detach().to(torch.float64)
        s = k.sum(dim=(0, 2))  # (H_kv, D)
        sq = (k * k).sum(dim=(0, 2))  # (H_kv, D)
        n = torch.linalg.vector_norm(k, dim=-1).sum(dim=(0, 2))  # (H_kv,)
        if layer in self.sum:
            self.sum[layer] += s
            self.sumsq[layer] += sq
            self.norm[layer] += n
            self.count[layer] += k.shape[0] * k.shape[2]
        else:
            self.sum[layer], self.sumsq[layer], self.norm[layer] = s, sq, n
            self.count[layer] = k.shape[0] * k.shape[2]

    def observe(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """SlimCache's ``observe=`` hook: the raw new keys of one layer update, ``(B, H_kv, T, D)``."""
        self.add(layer_idx, key_states)

    def means(self, n_layers: int) -> tuple[list[torch.Tensor], KStats]:
        missing = [il for il in range(n_layers) if not self.count.get(il)]
        if missing:
            raise ValueError(
                f"layers {missing} received no keys during calibration; only models whose every layer "
                f"is a standard attention layer are supported (not hybrid or KV-sharing models)"
            )
        means, norms, stds = [], [], []
        for il in range(n_layers):
            n = self.count[il]
            mean = self.sum[il] / n
            var = (self.sumsq[il] / n - mean * mean).clamp_min(0.0)
            means.append(mean.to(torch.float32).cpu())
            norms.append((self.norm[il] / n).cpu())
            stds.append(var.sqrt().cpu())
        return means, KStats(row_norm_mean=norms, channel_std=stds)


def chunk_spans(n_tokens: int, ctx: int, *, chunks: int | None = None, max_tokens: int | None = None):
    """The ``[start, end)`` token spans calibration runs.

    The first ``max_tokens`` tokens (all if None) are cut into chunks of ``ctx`` tokens. A final
    partial chunk is dropped when at least one full chunk exists (every chunk then sees the same
    positions, as in llama.cpp's tools); a text shorter than ``ctx`` is used whole as one chunk.
    ``chunks`` keeps only the first ``chunks`` spans.
    """
    check_positive_int("ctx", ctx)
    if chunks is not None:
        check_positive_int("chunks", chunks)
    if max_tokens is not None:
        check_positive_int("max_tokens", max_tokens)
    n = n_tokens if max_tokens is None else min(n_tokens, max_tokens)
    if n <= 0:
        raise ValueError("the calibration text has no tokens")
    full = n // ctx
    spans = [(i * ctx, (i + 1) * ctx) for i in range(full)] if full else [(0, n)]
    return spans if chunks is None else spans[:chunks]


def collect_k_means_from_ids(
    model,
    input_ids,
    *,
    ctx: int = 512,
    chunks: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
    cache_type: str = "q4_0",
    text_sha256: str | None = None,
    fingerprint: str | None = None,
    rotate: bool | str = "auto",
    pre_rope: bool = False,
    fit_rotation: bool = False,
) -> BiasSet:
    """Mean of the cached K per (layer, kv-head, channel) over a token sequence.

    input_ids: ``(T,)`` or ``(1, T)`` token ids (one unpadded sequence).
    ctx, chunks, max_tokens: how the tokens are cut (see :func:`chunk_spans`); each chunk runs
        through the model with a fresh cache, so positions restart at 0 in every chunk.
    cache_type: recorded in the result (the K format the bias is meant for).
    text_sha256: recorded in the result (:func:`collect_k_means` passes the text's sha256).
    fingerprint: the model fingerprint to record; None computes
        :func:`kvslim.calibration.fingerprint.model_fingerprint`.
    rotate, pre_rope: the K basis to calibrate for (a cache with ``rotate='k'``/``'kv'``, ``pre_rope=True``):
        the keys are averaged as that cache stores them, and the result records it. ``rotate='auto'``
        (default): the basis a default cache (``rotate='auto'``) stores a quantized K in — Hadamard-rotated
        wherever the model's head_dim allows it (:func:`default_rotate`) —, so that the default cache given
        the file rotates and centers (a file in another basis would switch its rotation off).
    fit_rotation: also fit a rotation of K and V per (layer, KV head) to the text
        (:func:`kvslim.calibration.rotation.fit_rotation`), in the file's K basis without the Hadamard
        (post- or pre-RoPE as ``pre_rope``), for a cache with ``rotate='fitted'``; the result's ``rotations``.
    Returns a :class:`~kvslim.calibration.meancenter.BiasSet` with ``(H_kv, D)`` float32 means and
    :class:`~kvslim.calibration.meancenter.KStats`.
    """
    from tqdm.auto import tqdm

    from ..cache.adapter import SlimCache  # imports transformers (seconds): at first use, not at import

    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be one sequence, shape (T,) or (1, T); got {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    spans = chunk_spans(ids.numel(), ctx, chunks=chunks, max_tokens=max_tokens)
    rotate = default_rotate(model.config) if rotate == "auto" else rotate
    if not isinstance(rotate, bool):
        raise ValueError(f"rotate must be True, False or 'auto', got {rotate!r}")
    n_layers = ModelShapes.from_config(model.config).n_layers
    device = next(model.parameters()).device
    sums = _KSums()
    moments = None
    observe = sums.observe
    if fit_rotation:
        from .rotation import MomentSums

        moments = MomentSums()

        def observe(layer_idx, key_states, value_states):
            sums.add(layer_idx, key_states)
            moments.add(layer_idx, "k", key_states)
            moments.add(layer_idx, "v", value_states)

    n_used = sum(e - s for s, e in spans)
    was_training = model.training
    model.eval()  # no dropout in the measured keys
    try:
        with (
            torch.inference_mode(),
            tqdm(total=n_used, unit="tok", desc="calibrating", disable=not progress, leave=False) as bar,
        ):
            for start, end in spans:
                chunk = ids[start:end].to(device)[None]  # (1, T_chunk)
                # A fresh uncompressed cache per chunk (positions restart at 0); the sums outlive it.
                cache = SlimCache(
                    kv_quantize="none",
                    rotate="k" if rotate else "none",
                    pre_rope=pre_rope,
                    config=model.config,
                    observe=observe,
                    observe_stored=rotate or pre_rope,
                )
                prefill(model, chunk, cache)
                bar.update(end - start)
    finally:
        model.train(was_training)
    means, stats = sums.means(n_layers)
    rotations = None if moments is None else _fit(moments, model.config, n_layers, bool(rotate))
    if n_used < MIN_USEFUL_TOKENS:
        noise = max(standard_error_ratio(m, sd, n_used) for m, sd in zip(means, stats.channel_std))
        warnings.warn(
            f"calibrating on {n_used} tokens: the bias is a noisy estimate (its standard error is up to "
            f"{noise:.0%} of |bias| in a layer); a useful bias needs at least {MIN_USEFUL_TOKENS} tokens "
            f"(the measured gains in docs/mean-center.md used 7168)",
            UserWarning,
            stacklevel=2,
        )
    return BiasSet(
        tensors=means,
        k_rot=bool(rotate),
        pre_rope=bool(pre_rope),
        model_fingerprint=model_fingerprint(model) if fingerprint is None else fingerprint,
        cache_type=cache_type,
        n_tokens=n_used,
        text_sha256=text_sha256,
        ctx=ctx,
        n_chunks=len(spans),
        stats=stats,
        rotations=rotations,
        rotation=None if rotations is None else ROTATION_METHOD,
    )


def _fit(moments, config, n_layers: int, k_rot: bool) -> dict[str, list[torch.Tensor]]:
    """The fitted rotations from the observed moments, K's taken off the Hadamard it was observed in:
    ``R_obs H`` maps the unrotated key to where ``R_obs`` maps its Hadamard image (H is its own inverse)."""
    from ..cache.hadamard import Hadamard, block_size
    from .rotation import fit_from_sums

    shapes = ModelShapes.from_config(config)
    blocks = {"k": block_size(shapes.k_head_dim), "v": block_size(shapes.v_head_dim)}
    rotations = fit_from_sums(moments, n_layers, blocks)
    if k_rot:
        h = Hadamard.for_head_dim(shapes.k_head_dim).matrix(dtype=torch.float64)
        rotations["k"] = [(r.double() @ h).to(torch.float32) for r in rotations["k"]]
    return rotations


def default_rotate(config) -> bool:
    """Whether a default SlimCache (``rotate='auto'``) stores a quantized K of this model Hadamard-rotated:
    wherever a Hadamard matrix of its K head_dim exists and K is not an MLA latent. Calibrating in that basis
    makes rotation and centering add up (docs/mean-center.md, "The default basis")."""
    from ..cache.hadamard import Hadamard
    from ..shapes import is_mla, text_config

    if is_mla(text_config(config)):
        return False
    try:
        Hadamard.for_head_dim(ModelShapes.from_config(config).k_head_dim)
    except ValueError:
        return False
    return True


def collect_k_means(
    model,
    tokenizer,
    text: str,
    *,
    ctx: int = 512,
    chunks: int | None = None,
    max_tokens: int | None = None,
    progress: bool = True,
    cache_type: str = "q4_0",
    fingerprint: str | None = None,
    rotate: bool | str = "auto",
    pre_rope: bool = False,
    fit_rotation: bool = False,
) -> BiasSet:
    """Calibrate on ``text``: tokenized once as a whole with the tokenizer's defaults (special
    tokens as ``tokenizer(text)`` adds them), then :func:`collect_k_means_from_ids`."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    ids = tokenizer(text)["input_ids"]
    return collect_k_means_from_ids(
        model,
        torch.tensor(ids, dtype=torch.long),
        ctx=ctx,
        chunks=chunks,
        max_tokens=max_tokens,
        progress=progress,
        cache_type=cache_type,
        text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        fingerprint=fingerprint,
        rotate=rotate,
        pre_rope=pre_rope,
        fit_rotation=fit_rotation,
    )
