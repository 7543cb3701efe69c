"""The direct paged step: a Llama, Mistral or Qwen2 model's paged forward without transformers' module stack.

:func:`~kvslim.cache.paged_adapter.forward_pages` runs ``model(...)`` on a step's packed tokens. Written out here,
the embedded model's (Llama) step at 4,096 tokens costs 4-9 ms less: 1.28x faster at one row, 1.06x at sixteen
(docs/performance.md, "The direct paged step"). Transformers' forward passes each of the 30 layers through its
checkpointing wrapper, its kwargs merging and deprecation decorators, its attention interface lookup and the
cache's ``update``, ~0.15-0.3 ms a layer of Python. :func:`step` makes the same calls on the same tensors in the
same order, so its logits are the model's own, bit for bit (tests/test_paged_direct.py):

- the embedding, the rotary embedding (the model's ``rotary_emb`` on the step's positions), each layer's norms,
  linear layers and activation through their ``forward`` (with the route of :class:`~kvslim.engine.linears.Linears`
  installed on them), the model's own ``apply_rotary_pos_emb``;
- the layer's attention as ``kvslim_attention`` makes it for a paged step: :meth:`PagePool.attend
  <kvslim.cache.pagepool.PagePool.attend>` on the (N, H, D) query, keys and values, its float32 output cast back to
  the model's dtype;
- the residual sums, the final norm over every token of the step, then the language-model head on the kept rows.

Between its calls into kvslim's C kernels it restarts their workers' spin three times a layer (:data:`RENEW`), where
a stretch of Python outlasts the 50 us spin at one row: the step at one row 0.93x the time (docs/performance.md, "How
long the workers spin").

What it skips is only what a paged step never uses: attention masks (the pool's calls are causal per row), output
capturing, gradient checkpointing, the cache object. :func:`step` returns None (the caller runs the model) where
any of this might not hold: another architecture, a subclass of one of its modules, a hook on any module of the
step, a forward of its own on a module whose forward it writes out (the model, its decoder, a layer, its attention
or MLP), training mode, autograd or a trace recording, an attention implementation other than kvslim's, a sliding
window, a model with more layers than its config runs.

This module knows nothing about page formats, slots or rows (:mod:`kvslim.cache.pagepool` does), nor about
scheduling or sampling.
"""

from __future__ import annotations

import torch

#: whether :func:`~kvslim.cache.paged_adapter.forward_pages` takes the direct step where a model allows it (False:
#: always the model's own forward; for A/B measurements and tests)
ENABLED = True

#: whether :func:`step` restarts the C kernels' workers' spin inside each of a layer's three long stretches of
#: Python (:func:`kvslim.kernels.clib.pool_renewer`; False: for A/B measurements)
RENEW = True

#: kvslim's attention implementation (:data:`kvslim.attention.NAME`; not imported from there: the attention
#: imports this module's caller, and a test checks the two agree)
ATTENTION = "kvslim"


#: the families whose modules compute exactly what :func:`step` writes out: the causal-LM class's name ->
#: (modeling module, decoder, decoder layer, attention, MLP class names, what a layer's attention hands the
#: attention function as its sliding window, which must be None: a paged step attends over whole rows)
FAMILIES = {
    "LlamaForCausalLM": ("llama", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", lambda a: None),
    "MistralForCausalLM": (
        "mistral", "MistralModel", "MistralDecoderLayer", "MistralAttention", "MistralMLP",
        lambda a: getattr(a.config, "sliding_window", None),
    ),
    "Qwen2ForCausalLM": (
        "qwen2", "Qwen2Model", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", lambda a: a.sliding_window,
    ),
}  # fmt: skip


def _family(model):
    """``model``'s entry of :data:`FAMILIES` with its classes resolved: (modeling module, its classes..., window), or
    None where its class is not one of them (a subclass included)."""
    entry = FAMILIES.get(type(model).__name__)
    if entry is None:
        return None
    import importlib

    module = importlib.import_module(f"transformers.models.{entry[0]}.modeling_{entry[0]}")
    top = getattr(module, type(model).__name__, None)
    if type(model) is not top:
        return None
    return (module, top, *(getattr(module, name) for name in entry[1:5]), entry[5])


def _plain(module, cls) -> bool:
    """``module`` is exactly ``cls`` (no subclass), in eval mode, with no forward of its own and no hook: calling
    its class's forward in its place changes nothing."""
    return (
        type(module) is cls and not module.training and "forward" not in module.__dict__ and _hookless(module)
    )


def _hookless(module) -> bool:
    """No hook on ``module``: ``module.forward(x)`` is what calling it runs (outside a trace). (Read from the
    module's ``__dict__``, where ``nn.Module.__init__`` puts the hook dicts: ~400 modules a step, one look each.)"""
    d = module.__dict__
    return not (
        d.get("_forward_hooks") or d.get("_forward_pre_hooks") or d.get("_backward_hooks")
        or d.get("_backward_pre_hooks")
    )


def _child(module, name: str):
    """``getattr(module, name)`` for a submodule, without ``nn.Module.__getattr__``'s slow path where it is one of
    ``module``'s registered children and nothing in its ``__dict__`` shadows it (the same object either way)."""
    d = module.__dict__
    if name not in d:
        child = d["_modules"].get(name)
        if child is not None:
            return child
    return getattr(module, name)


def why_not(model) -> str | None:
    """Why the direct step does not serve ``model`` now, or None where it does."""
    return _check(model)[0]


def _check(model) -> tuple[str | None, object]:
    """(:func:`why_not`'s answer, the family's modeling module where it is None): one look a step."""
    if not ENABLED:
        return "off (kvslim.cache.paged_direct.ENABLED)", None
    if torch.is_grad_enabled():
        return "autograd is recording", None
    family = _family(model)
    if family is None:
        return f"{type(model).__name__} is not one of {', '.join(FAMILIES)} (transformers' own classes)", None
    return _why_not_in(model, *family), family[0]


def _why_not_in(model, _modeling, top, decoder_cls, layer_cls, attn_cls, mlp_cls, window) -> str | None:
    """:func:`why_not` for a model of a family of :data:`FAMILIES` (its classes resolved by :func:`_family`)."""
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks:
        return "a global module hook is registered"
    if not _plain(model, top) or not _plain(model.model, decoder_cls):
        return "the model or its decoder has a forward or hook of its own, or is training"
    config = model.config
    if torch._C._get_tracing_state() is not None:
        return "a trace is recording"
    decoder = model.model
    if not all(map(_hookless, (decoder.embed_tokens, decoder.rotary_emb, decoder.norm, model.lm_head))):
        return "the embedding, rotary embedding, final norm or head has a hook"
    if getattr(config, "_attn_implementation", None) != ATTENTION:
        return (
            f"its attention implementation is {getattr(config, '_attn_implementation', None)!r}, not kvslim's"
        )
    layers = model.model.layers
    if len(layers) != config.num_hidden_layers:
        return f"it has {len(layers)} layers and its config runs {config.num_hidden_layers}"
    for i, layer in enumerate(layers):
        if not (
            _plain(layer, layer_cls)
            and _plain(attn := _child(layer, "self_attn"), attn_cls)
            and _plain(mlp := _child(layer, "mlp"), mlp_cls)
        ):
            return f"layer {i}'s modules are not plain {layer_cls.__name__} ones (a subclass, a hook or a forward)"
        for module, names in ((layer, _LAYER_CALLED), (mlp, _MLP_CALLED), (attn, _ATTN_CALLED)):
            for name in names:
                if not _hookless(_child(module, name)):
                    return f"a module of layer {i} has a hook"
        if window(attn) is not None:
            return f"layer {i} attends in a sliding window"
    return None


#: the modules of a layer :func:`step` calls through their forward, by their parent: the layer, its MLP, its attention
_LAYER_CALLED = ("input_layernorm", "post_attention_layernorm")
_MLP_CALLED = ("act_fn", "gate_proj", "up_proj", "down_proj")
_ATTN_CALLED = ("q_proj", "k_proj", "v_proj", "o_proj")


def step(model, pool, plan, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """One paged step of ``model`` (one of :data:`FAMILIES`) on ``input_ids`` (N,) int64, the step's tokens packed
    (filler rows included) with ``plan`` (:meth:`PagePool.plan <kvslim.cache.pagepool.PagePool.plan>`): (len(keep), V)
    logits in the model's dtype, the rows ``keep`` (K,) of the step's tokens, as ``model(..., logits_to_keep=keep)``
    computes them; or None, nothing done, where the direct step does not serve the model now (:func:`why_not`)."""
    reason, modeling = _check(model)
    if reason is not None:
        return None
    decoder = model.model
    # every module is called through its forward: why_not saw no hook on any, and no trace (what nn.Module's
    # __call__ checks before it calls forward; ~330 calls a step, ~1 ms of Python at 16 rows)
    hidden = decoder.embed_tokens.forward(input_ids[None])  # (1, N, hidden): as the model embeds them
    # (1, N, D) each, on the step's positions
    cos, sin = decoder.rotary_emb.forward(hidden, position_ids=plan.positions.to(hidden.device))
    cos, sin = cos[0], sin[0]  # (N, D)
    h = hidden[0]  # (N, hidden)
    n = h.shape[0]
    # Three stretches of Python a layer (a residual sum and RMSNorm twice, RoPE and the pool's tables) outlast the
    # workers' 50 us spin at one row: restarting it inside each keeps the workers awake for the next call.
    renew = renewer()
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        renew()
        x = layer.input_layernorm.forward(h)
        d = attn.head_dim
        q = attn.q_proj.forward(x).view(n, -1, d)  # (N, H_q, D)
        k = attn.k_proj.forward(x).view(n, -1, d)  # (N, H_kv, D)
        v = attn.v_proj.forward(x).view(n, -1, d)  # (N, H_kv, D)
        # cos (N, 1, D) against (N, H, D)
        q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        renew()  # (after RoPE: the pool's Python follows, 80-90 us from v_proj's end to the attention's call)
        out = pool.attend(plan, attn.layer_idx, q, k, v, attn.scaling).to(q.dtype)  # (N, H_q, D)
        h = h + attn.o_proj.forward(out.reshape(n, -1))
        renew()
        x = layer.post_attention_layernorm.forward(h)
        h = h + mlp.down_proj.forward(mlp.act_fn.forward(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
    h = decoder.norm.forward(h)  # every token's row, as the model's decoder normalizes them all
    return model.lm_head.forward(h[keep])  # (K, V)


def renewer():
    """The workers' spin renewer a step calls before a long stretch of Python: :func:`kvslim.kernels.clib.pool_renewer`'s
    function, or a no-op where :data:`RENEW` is off (the compiled step's page attention calls it too)."""
    return _renewer(RENEW)


def _renewer(on: bool):
    """:func:`kvslim.kernels.clib.pool_renewer`'s function, or its no-op where ``on`` is False."""
    from ..kernels.clib import no_renew, pool_renewer

    return pool_renewer() if on else no_renew
