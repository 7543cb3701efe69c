"""What the engine checks before it serves a model or takes a request, and the empty cache a request gets.

A :class:`Gate` is built once per :class:`~kvslim.engine.engine.Engine`: it refuses the models the batch engine
cannot serve exactly (MLA, RoPE whose frequencies follow the whole batch, layers that store no K/V), reads the
default cache's ``mean_center`` bias file once (checked against the model's fingerprint), and for each submitted
request runs the checks that need no lock (:meth:`Gate.check`: vocabulary, prompt length, settings, context,
budget), building the request's empty cache on the way. It knows nothing of the queue, the rows or a step.
"""

from __future__ import annotations

from ..config import CacheConfig
from .errors import BudgetRefusal, ContextRefusal, InputRefusal, RequestLimits, SettingsRefusal

#: RoPE types whose frequencies transformers computes from the largest position id of the whole batch
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


class Gate:
    """model: the loaded transformers causal LM (ValueError for one the engine cannot serve); default_cache: the
    engine's default settings (they must fit this model); request_limits, max_prompt_tokens: what a request may
    ask (:meth:`check`); fingerprint: whether the model's fingerprint is needed (sessions parked on disk or a bias
    file: computed once, here); allow_other_model: take a bias file calibrated for another model."""

    def __init__(
        self,
        model,
        default_cache: CacheConfig,
        *,
        request_limits: RequestLimits,
        max_prompt_tokens: int | None,
        fingerprint: bool,
        allow_other_model: bool,
    ):
        from ..cache.levers import rotary_embedding
        from ..shapes import ModelShapes, is_mla, text_config

        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"Engine needs a loaded transformers model, got {type(model).__name__}")
        self.shapes = ModelShapes.from_config(config)
        if is_mla(text_config(config)):
            raise ValueError(
                f"the batch engine cannot serve {self.shapes.model_type}: MLA expands its cached latent before "
                "attention, so there are no per-row codes to attend on"
            )
        emb, _ = rotary_embedding(config)
        rope_type = getattr(emb, "rope_type", "default") if emb is not None else "default"
        if rope_type in BATCH_DEPENDENT_ROPE:
            raise ValueError(
                f"the batch engine cannot serve {self.shapes.model_type} with rope_type {rope_type!r}: its frequencies "
                "follow the longest position in the whole batch, so one row would change every other row's results "
                "(run it one stream at a time with kvslim.generate)"
            )
        import kvslim

        self.model = kvslim.enable(model)  # the kvslim attention: ragged steps need it
        self.config = self.model.config
        self.default_cache = default_cache
        self.request_limits = request_limits
        self.max_prompt_tokens = max_prompt_tokens
        self.vocab_size = int(getattr(text_config(config), "vocab_size", 0) or 0)
        self.dtype = next(model.parameters()).dtype
        self.fingerprint = None
        if fingerprint or default_cache.mean_center is not None:
            from ..calibration.fingerprint import model_fingerprint

            self.fingerprint = model_fingerprint(model)
        self._allow_other_model = allow_other_model
        self._bias = self.read_bias(default_cache.mean_center)
        self.make(default_cache)  # the default settings must fit this model (raises if not)

    @staticmethod
    def read_bias(path):
        """The default cache's bias file, read once (every cache built from it shares the tensors)."""
        if path is None:
            return None
        from ..calibration.biasfile import read_bias_file

        try:
            return read_bias_file(path)
        except OSError as e:
            raise ValueError(f"the cache's mean_center bias file {path!r} cannot be read: {e.strerror or e}") from None

    def make(self, cfg: CacheConfig):
        """An empty :class:`~kvslim.SlimCache` with ``cfg`` for this model (ValueError: settings it cannot take)."""
        from ..cache.adapter import SlimCache
        from ..cache.layer_adapter import SlimCacheLayer

        if cfg.mean_center is None:
            cache = SlimCache.from_config(cfg, config=self.config)
        else:  # only ever the default's file (check() refuses others), loaded once, checked against the model
            cache = SlimCache.from_config(
                cfg,
                config=self.config,
                mean_center=self._bias,
                model_fingerprint=self.fingerprint,
                allow_other_model=self._allow_other_model,
            )
            cache.cache_config = cfg  # its settings name the file its bias came from (a parked session records it)
        kinds = sorted(
            {type(layer).__name__ for layer in cache.layers if not isinstance(layer, SlimCacheLayer)}
        )
        if kinds or any(type(layer).__name__ == "SlimHybridLayer" for layer in cache.layers):
            raise ValueError(
                f"the batch engine serves models whose every layer stores K/V; {self.shapes.model_type} has "
                f"{', '.join(kinds) or 'hybrid'} layers (run it one stream at a time with kvslim.generate)"
            )
        return cache

    def check_input(self, request) -> None:
        """The checks of ``request``'s tokens: :class:`InputRefusal` for a token id outside the vocabulary or a prompt
        past ``max_prompt_tokens``."""
        n_prompt = len(request.prompt)
        top = max(request.prompt)
        if self.vocab_size and top >= self.vocab_size:
            raise InputRefusal(
                f"prompt token id {top} is outside the model's vocabulary (0..{self.vocab_size - 1})"
            )
        if self.max_prompt_tokens is not None and n_prompt > self.max_prompt_tokens:
            raise InputRefusal(
                f"the prompt has {n_prompt} tokens, more than this server takes ({self.max_prompt_tokens}, "
                "max_prompt_tokens)"
            )

    def check(self, request, *, prefill_chunk: int, scheduler) -> tuple:
        """Every check of ``request`` that needs no lock, in the order a client is best told about them; returns
        ``(empty cache, bytes to reserve)``. Raises :class:`InputRefusal` (a token id outside the vocabulary, a
        prompt past ``max_prompt_tokens``), :class:`SettingsRefusal` (cache settings this model cannot take, or
        past ``request_limits``), :class:`ContextRefusal` (prompt + max_new_tokens past the model's context
        without bounded position ids), :class:`BudgetRefusal` (cannot fit ``scheduler``'s budget even alone)."""
        self.check_input(request)
        n_prompt = len(request.prompt)
        cfg = request.cache or self.default_cache
        ctx = self.shapes.max_position_embeddings
        if request.cache is not None and request.cache != self.default_cache:
            self.request_limits.check(cfg, context=ctx)  # SettingsRefusal
            if cfg.mean_center is not None and cfg.mean_center != self.default_cache.mean_center:
                raise SettingsRefusal(
                    "cache setting mean_center: a request can only use the engine's own bias file (read once "
                    "when it started), not a file of its choosing"
                )
        total = n_prompt + request.max_new_tokens
        try:
            cache = self.make(cfg)  # raises ValueError for settings this model cannot take
        except ValueError as e:
            raise SettingsRefusal(str(e)) from None
        # Past the context only a bounded cache whose position ids are re-based (kept below the period plus a
        # chunk) stays inside it; any other cache would feed ids the model was never trained on.
        bounded_ids = cache.rebase_period is not None and cache.rebase_period + prefill_chunk <= (ctx or 0)
        if ctx is not None and total > ctx and not bounded_ids:
            why = (
                "the cache has no window"
                if cfg.window is None
                else "this cache's position ids are not kept bounded"
            )
            raise ContextRefusal(
                f"prompt ({n_prompt} tokens) + max_new_tokens ({request.max_new_tokens}) = {total} is past "
                f"the model's context of {ctx} tokens, and {why}: shorten it, or use a bounded cache "
                f"(sink=4,window=...) whose positions stay inside the context"
            )
        reserved = cache.projected_nbytes(total, dtype=self.dtype)
        if not scheduler.fits_alone(reserved):
            raise BudgetRefusal(
                f"this request's cache can reach {reserved} bytes ({cfg.to_spec()}, {total} tokens), more than the "
                f"whole memory budget of {scheduler.memory_budget} bytes: raise the budget, lower max_new_tokens "
                f"or use a smaller cache (a window, fewer bits)"
            )
        return cache, reserved
