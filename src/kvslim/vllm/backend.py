"""kvslim's attention backend for vLLM 0.32's CPU platform: vLLM's classes, and nothing else.

vLLM's CPU platform always returns ``CPU_ATTN``'s class path (``--attention-backend CUSTOM`` is ignored on CPU),
so :func:`kvslim.vllm.register` points ``CPU_ATTN`` at :class:`KvslimCPUBackend` with ``register_backend``.

- :meth:`KvslimCPUBackend.customize_spec` sets the page layout: storage dtype uint8 and ``state_content_bytes``
  = bytes of one token of one KV head in kvslim's formats (:class:`~kvslim.vllm.pages.PageLayout`), so vLLM's
  KV-cache manager counts its blocks in those bytes: the capacity it reports at start-up is kvslim's.
- kernel blocks of 32 tokens (one page per (block, KV head): one GGML / KIVI group); vLLM splits its manager
  blocks (128 tokens on CPU by default) into pages, and hands slot mappings and block tables in pages.
- :meth:`KvslimCPUImpl.do_kv_cache_update` encodes each step's new tokens and writes them through the slot
  mapping; :meth:`KvslimCPUImpl.forward` attends on the codes of each request's history and on the raw K/V of
  the step's own tokens (:func:`kvslim.vllm.attend.attend`).
- staged partial pages (lossy formats): the metadata builder plans, once per step, which pages are being filled
  and where their tokens go in a staging pool (:class:`~kvslim.vllm.staging.Stager`, one per engine); each layer
  copies its step's raw K/V there (:meth:`KvslimCPUImpl.forward`, its own pool) and the kernel reads a partly
  filled page from its slot at full precision instead of its codes.

Opt-in: an engine that gives no kvslim spec (:func:`kvslim.vllm.spec.given`) gets vLLM's own CPU backend, its
implementation, builder, block sizes and spec untouched (:func:`active` decides, per engine, when vLLM builds the
attention layers), so installing kvslim in vLLM's environment changes nothing until a spec is given.

The spec is read when vLLM builds a layer's implementation (engine start: a bad spec fails there with one line)
from ``additional_config["kvslim"]`` or ``$KVSLIM_VLLM_SPEC`` (:mod:`.spec`). ``customize_spec`` is a class
method that vLLM calls after building the layers; it reads the layout this process built last (one engine
per worker process; in-process engines build their layers before their cache spec).

Refused at start, one line each: vLLM's own ``--kv-cache-dtype`` other than ``auto`` (the format is kvslim's),
ALiBi, logits soft-capping, attention sinks (gpt-oss), encoder / cross attention.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from . import attend as paged
from .basis import ModelShape, PageBasis
from .basis import attend as attend_in_basis
from .pages import PAGE_TOKENS, PageLayout
from .spec import from_sources, given, sink_pages
from .staging import Stager, pool_bytes, sink_pages_of, slots_from_env

logger = init_logger("vllm.kvslim")  # under vLLM's configured "vllm" logger, so its INFO lines show

#: The page layout built last in this process, by head size (what customize_spec reads).
_LAYOUTS: dict[int, PageLayout] = {}
#: The rotation of the pages built last in this process, by head size (for the start-up line).
_BASES: dict[int, PageBasis] = {}
#: Whether the engine built last in this process gave a kvslim spec ("active"), for the calls made without vLLM's
#: current config set.
_STATE: dict[str, bool] = {}


def active() -> bool:
    """Whether this engine stores kvslim pages: it gave a spec (else vLLM's own CPU backend runs). Read from vLLM's
    current config when one is set (engine start), else what the last engine of this process decided."""
    config = get_current_vllm_config_or_none()
    if config is not None:
        _STATE["active"] = given(config.additional_config)
    return _STATE.get("active", False)


def layout_for(vllm_config: VllmConfig, head_size: int) -> PageLayout:
    """The page layout of this engine's spec for ``head_size`` (ValueError in one line for a bad spec)."""
    return _pages_for(vllm_config, head_size)[0]


def _pages_for(vllm_config: VllmConfig, head_size: int) -> tuple[PageLayout, PageBasis]:
    """The page layout of this engine's spec for ``head_size`` and the rotation its pages are stored in (ValueError
    in one line for a bad spec, a rotation included)."""
    config = from_sources(vllm_config.additional_config)
    model_dtype = vllm_config.model_config.dtype
    try:
        layout = PageLayout.of(config.k_format, config.v_format, head_size, model_dtype)
    except ValueError as e:
        raise ValueError(f"kvslim: {' '.join(str(e).split())}") from None
    mc = vllm_config.model_config
    model = ModelShape(
        mc.hf_text_config.num_hidden_layers, mc.get_total_num_kv_heads(), getattr(mc.hf_config, "model_type", None)
    )
    rotation = PageBasis.of(config, layout, model)
    _LAYOUTS[head_size], _BASES[head_size] = layout, rotation
    return layout, rotation


class KvslimCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend, storing pages in kvslim's formats (module docstring); vLLM's own
    ``CPUAttentionBackend`` for an engine that gives no kvslim spec."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        # vLLM's --kv-cache-dtype is a closed list; kvslim's format is its spec, so only "auto" is taken.
        if active():
            return kv_cache_dtype in (None, "auto")
        return super().supports_kv_cache_dtype(kv_cache_dtype)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        if active():
            return [PAGE_TOKENS]
        return CPUAttentionBackend.get_supported_kernel_block_sizes(kv_cache_spec)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [] if active() else super().get_supported_head_sizes()

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        if active():
            return attn_type == AttentionType.DECODER
        return super().supports_attn_type(attn_type)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """uint8 pages, ``state_content_bytes`` = one token of one KV head in kvslim's formats (K then V)."""
        if not active() or (spec.dtype == torch.uint8 and spec.state_content_bytes is not None):
            return spec  # vLLM's own pages, or already ours
        config = get_current_vllm_config_or_none()
        layout = layout_for(config, spec.head_size) if config is not None else _LAYOUTS.get(spec.head_size)
        if layout is None:
            raise RuntimeError("kvslim: the page layout is asked for before any attention layer was built")
        if spec.head_size_v != spec.head_size:
            raise ValueError(
                f"kvslim: K and V head sizes differ ({spec.head_size}, {spec.head_size_v}): not supported"
            )
        rotated = _BASES.get(spec.head_size)
        logger.info_once(
            "kvslim pages: K %s, V %s, %d bytes per token and KV head (%s bytes in %s), Hadamard-rotated: %s; "
            "attention: %s",
            layout.k.name,
            layout.v.name,
            layout.row_bytes,
            2 * spec.head_size * spec.dtype.itemsize,
            spec.dtype,
            "?" if rotated is None else rotated.name,
            paged.status(),
        )
        return replace(spec, dtype=torch.uint8, state_content_bytes=layout.row_bytes)

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return KvslimCPUImpl if active() else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return KvslimMetadataBuilder if active() else CPUAttentionMetadataBuilder


@dataclass
class KvslimMetadata:
    """One step's attention metadata, shared by every layer: the rows (:class:`~kvslim.vllm.attend.Rows`)."""

    num_actual_tokens: int
    rows: paged.Rows
    slot_mapping: torch.Tensor
    causal: bool = True
    #: staged partial pages (None: none): the engine's page -> slot map, this step's tokens' rows in the pools
    stage_map: torch.Tensor | None = None
    stage_dest: torch.Tensor | None = None
    stage_slots: int = 0


class KvslimMetadataBuilder(AttentionMetadataBuilder[KvslimMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # one Stager per engine (this builder's layers share it); lossless pages need no staging
        layout = layout_for(vllm_config, kv_cache_spec.head_size)
        sinks = sink_pages(from_sources(vllm_config.additional_config))
        # a slot per running sequence for its partly filled page, and one per sink page (kvslim.vllm.staging)
        slots = slots_from_env(vllm_config.scheduler_config.max_num_seqs * (1 + sinks))
        lossy = layout.k.family != "cast" or layout.v.family != "cast"
        if sinks and lossy and slots == 0:
            raise ValueError(
                "kvslim: sink keeps each sequence's first pages in the staging pool, which "
                "$KVSLIM_VLLM_STAGED_SLOTS=0 turns off; give it slots or drop sink"
            )
        self.stager = Stager(slots, sink_pages=sinks) if lossy and slots > 0 else None
        if self.stager is not None:
            size = vllm_config.model_config.dtype.itemsize
            per_layer = pool_bytes(slots, 1, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size, size)
            logger.info_once(
                "kvslim staging: %d slots of a partly filled page per layer, %d bytes per layer outside the KV "
                "space (%d layers: %.1f MiB)",
                slots,
                per_layer,
                len(layer_names),
                per_layer * len(layer_names) / 2**20,
            )

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KvslimMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor):
            raise NotImplementedError("kvslim: per-token causal masks (prefix-LM models) are not supported")
        rows = paged.Rows.of(m.query_start_loc_cpu, m.seq_lens.cpu(), m.block_table_tensor)
        meta = KvslimMetadata(m.num_actual_tokens, rows, m.slot_mapping, bool(m.causal))
        if self.stager is not None:
            sinks = sink_pages_of(m.block_table_tensor, m.seq_lens, self.stager.sink_pages)
            meta.stage_dest = self.stager.plan(m.slot_mapping[: m.num_actual_tokens], sinks)
            meta.stage_map, meta.stage_slots = self.stager.map, self.stager.slots
        return meta


class KvslimCPUImpl(AttentionImpl):
    """Writes through the slot mapping in kvslim's formats; attends on the codes over block tables."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        refused = {
            "ALiBi": alibi_slopes is not None,
            "logits soft-capping": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            f"{attn_type} attention": attn_type != AttentionType.DECODER,
            f"--kv-cache-dtype {kv_cache_dtype} (give kvslim's format in additional_config or $KVSLIM_VLLM_SPEC)": (
                kv_cache_dtype != "auto"
            ),
        }
        for what, bad in refused.items():
            if bad:
                raise ValueError(f"kvslim: {what} is not supported by kvslim's vLLM backend")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window or 0
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        config = get_current_vllm_config()
        self.layout, self.basis = _pages_for(config, head_size)
        if self.basis.k_bias is not None and self.basis.k_bias[0].shape[0] != num_kv_heads:
            raise ValueError(
                f"kvslim: mean_center holds a bias for {self.basis.k_bias[0].shape[0]} KV heads, this layer has "
                f"{num_kv_heads} (a tensor-parallel rank holds a share of them): not supported with tensor parallel"
            )
        self.stage_layout = PageLayout.of("none", "none", head_size, config.model_config.dtype)
        self.staged: torch.Tensor | None = None  # this layer's staging pool, made on first use
        self._layer: int | None = None  # the model layer (its K bias), read from the first call's layer name
        self._rotated = None  # do_kv_cache_update's (stamp of the K/V, keys, values in the basis)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KvslimMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query: (N, H_q, D); kv_cache: uint8 (pages, H_kv, 32, row_bytes); output: (N, H_q, D)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvslim: fused output quantization is not supported")
        layer_idx = self._layer_index(layer)  # read at the warm-up call: a bad layer name fails at engine start
        if attn_metadata is None:  # warm-up
            return output
        n = attn_metadata.num_actual_tokens
        # The step's own tokens are attended on their raw K/V, the history on the pages' codes (kvslim.vllm.attend);
        # a layer sharing another's KV cache has no K/V of its own: everything from the pages.
        raw = key is not None and value is not None and self.kv_sharing_target_layer_name is None
        # A rotated cache (kvslim.vllm.basis): the step's K/V and the queries in the stored basis, the output back
        keys = values = None
        if raw:
            keys, values = self._in_basis(key, value, layer_idx)
            keys, values = keys[:n], values[:n]
        self._rotated = None  # do_kv_cache_update's K/V serve this forward only
        staged = None
        if raw and attn_metadata.stage_map is not None:  # this step's tokens into their staging slots first
            if self.staged is None:
                shape = (
                    attn_metadata.stage_slots,
                    kv_cache.shape[1],
                    kv_cache.shape[2],
                    self.stage_layout.row_bytes,
                )
                self.staged = torch.empty(shape, dtype=torch.uint8)  # a row is read only once written
            paged.store(self.stage_layout, self.staged, keys, values, attn_metadata.stage_dest)
            staged = paged.Staged(self.staged, self.stage_layout, attn_metadata.stage_map)
        attend_in_basis(
            self.basis,
            self.layout,
            kv_cache,
            query[:n],
            output[:n],
            attn_metadata.rows,
            self.scale,
            self.sliding_window,
            attn_metadata.causal,
            keys,
            values,
            staged,
        )
        return output

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """key, value: (N, H_kv, D): encoded once (in the pages' basis) and stored in their slots. The K/V in the
        basis are kept for this layer's :meth:`forward`, which vLLM calls next on the same tensors."""
        keys, values = self._in_basis(key, value, self._layer_index(layer), keep=True)
        paged.store(self.layout, kv_cache, keys, values, slot_mapping)

    def _in_basis(self, key, value, layer_idx, keep=False) -> tuple[torch.Tensor, torch.Tensor]:
        """``key``, ``value`` (N, H_kv, D) in the pages' basis (:meth:`PageBasis.stored`: one C call where it takes
        them), rotated once a layer and step: :meth:`do_kv_cache_update` keeps what it rotated (``keep``), and
        :meth:`forward` takes it where it is handed the same tensors (their storage, shape, strides and version counter
        where they have one), and forgets it; anything else is rotated again."""
        stamp = (_stamp(key), _stamp(value))
        kept = self._rotated
        if kept is not None and kept[0] == stamp:
            return kept[1], kept[2]
        keys, values, _ = self.basis.stored(key, value, layer_idx)
        self._rotated = (stamp, keys, values) if keep else None
        return keys, values

    def _layer_index(self, layer) -> int | None:
        """The model layer of vLLM's attention ``layer`` (its name, ``model.layers.12.self_attn.attn``), read once: which
        K bias its keys take (None where the pages are not centered)."""
        if self.basis.k_bias is None:
            return None
        if self._layer is None:
            from vllm.model_executor.models.utils import extract_layer_index

            name = getattr(layer, "layer_name", None)
            try:
                index = extract_layer_index(name)
            except Exception:  # noqa: BLE001 - vLLM asserts on a name without one layer index
                index = None
            if index is None or not 0 <= index < len(self.basis.k_bias):
                raise ValueError(
                    f"kvslim: mean_center: attention layer {name!r} is not one of the {len(self.basis.k_bias)} model "
                    f"layers the bias file has (draft / MTP layers are not supported with mean_center)"
                )
            self._layer = index
        return self._layer


def _stamp(t: torch.Tensor) -> tuple:
    """What identifies ``t``'s values between two calls of one layer: its storage, view and version counter (an
    inference tensor, vLLM's under ``torch.inference_mode``, has none: its storage and view)."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, None if t.is_inference() else t._version)
