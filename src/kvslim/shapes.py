"""The attention geometry of a model, read from its config once: the only place that parses it.

A KV cache's size and layout depend on a handful of numbers — layers, query heads, KV heads,
head_dim — plus the context length the model was trained for. transformers configs spell them in
several ways (``head_dim`` present or derived from ``hidden_size``; ``num_key_value_heads`` absent
for multi-head attention; multimodal configs nesting a text config). This module reads them from
any of those and knows nothing else: no tensors, no transformers import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelShapes:
    """``n_layers`` decoder layers, ``n_heads`` query heads, ``n_kv_heads`` KV heads of ``head_dim``
    channels each; ``max_position_embeddings`` (None when the config has none); ``model_type``.

    ``k_head_dim`` / ``v_head_dim``: the widths of one cached "key" and "value". They equal ``head_dim``
    except where transformers caches tensors of different widths: DeepSeek-V2/V3's multi-head latent
    attention (MLA) caches its compressed latent ``(B, 1, T, kv_lora_rank)`` in the key slot and the
    shared rotary key ``(B, 1, T, qk_rope_head_dim)`` in the value slot (``n_kv_heads`` is then 1).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None = None
    model_type: str = ""
    k_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        if not self.k_head_dim:
            object.__setattr__(self, "k_head_dim", self.head_dim)
        if not self.v_head_dim:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @classmethod
    def from_config(cls, config) -> ModelShapes:
        """From a transformers config (a multimodal one's text config is used).

        Raises ValueError for a config that is not a decoder language model's.
        """
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_layers = getattr(text, "num_hidden_layers", None)
        n_heads = getattr(text, "num_attention_heads", None)
        if n_layers is None or n_heads is None:
            raise ValueError(
                f"{type(config).__name__} has no num_hidden_layers/num_attention_heads: not a decoder LM config"
            )
        n_kv = getattr(text, "num_key_value_heads", None) or n_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
        k_dim = v_dim = head_dim
        if is_mla(text):  # transformers caches MLA's compressed latent: one "head" each
            k_dim, v_dim, n_kv = int(text.kv_lora_rank), int(text.qk_rope_head_dim), 1
        return cls(
            n_layers=int(n_layers),
            n_heads=int(n_heads),
            n_kv_heads=int(n_kv),
            head_dim=int(head_dim),
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            model_type=str(getattr(text, "model_type", "") or type(config).__name__),
            k_head_dim=k_dim,
            v_head_dim=v_dim,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def text_config(config):
    """The decoder text config of a (possibly multimodal) transformers config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def is_mla(config) -> bool:
    """Whether a (text) config is DeepSeek-style multi-head latent attention, cached as its latent."""
    return bool(getattr(config, "kv_lora_rank", None)) and bool(getattr(config, "qk_rope_head_dim", None))
