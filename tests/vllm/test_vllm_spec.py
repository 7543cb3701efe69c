"""kvslim.vllm's spec sources and registration: kvslim's own validation messages, one line each; what a page
cannot honour refused; ``import kvslim.vllm`` imports nothing of vLLM. Fast; register() needs vLLM installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvslim.config import parse_spec
from kvslim.vllm import check_version
from kvslim.vllm.spec import ENV, from_sources, given


def test_sources():
    assert from_sources(None, {}).k_format == "none"
    assert from_sources({"kvslim": "q4_0"}, {}).kv_quantize == "q4_0"
    assert from_sources({"kvslim": {"kv_quantize": "q8_0", "k_quantize": "q4_0"}}, {}).k_format == "q4_0"
    assert from_sources({}, {ENV: "int8,v=int4"}).v_format == "int4"
    assert from_sources({"other": 1}, {ENV: " "}).k_format == "none"


def test_a_spec_is_opt_in():
    assert not given(None, {}) and not given({"other": 1}, {ENV: "  "})
    assert given({"kvslim": "none"}, {}) and given(None, {ENV: "q4_0"})


def _message(additional, environ=None) -> str:
    with pytest.raises(ValueError) as e:
        from_sources(additional, environ or {})
    text = str(e.value)
    assert "\n" not in text and text.startswith("kvslim: ")
    return text


def test_bad_specs_say_what_slimcaches_say():
    for bad in ("q9_9", "q4_0,bogus=1", "q4_0,k=int5"):
        with pytest.raises(ValueError) as e:
            parse_spec(bad)
        assert _message({"kvslim": bad}) == f"kvslim: {e.value}"
        assert _message(None, {ENV: bad}) == f"kvslim: {e.value}"
    assert "unknown KV format 'nope'" in _message({"kvslim": {"kv_quantize": "nope"}})
    assert "unexpected keyword" in _message({"kvslim": {"kv_quantise": "q4_0"}})
    assert "spec string" in _message({"kvslim": 4})
    assert "give one" in _message({"kvslim": "q4_0"}, {ENV: "q8_0"})


@pytest.mark.parametrize(
    "spec,words",
    [
        ("q4_0,sink=4,window=60", "KV-cache manager"),
        ("q4_0,window=60", "KV-cache manager"),
        ("int4,residual=64", "residual"),
        ("int2", "per-channel"),
        ("q4_0,keep_layers=first", "per-layer"),
        ("int4,pre_rope=1", "RoPE"),
    ],
)
def test_what_a_page_cannot_honour_is_refused(spec, words):
    assert words in _message({"kvslim": spec})


def test_rotate_and_pre_rope_auto_are_taken():
    """pre_rope=auto resolves to off in vLLM; rotate=auto is resolved on the page layout (tests/test_vllm_basis.py)."""
    config = from_sources({"kvslim": "int4,v=int2,rotate=auto,pre_rope=auto"}, {})
    assert (config.k_format, config.v_format, config.rotate) == ("int4", "int2", "auto")


def test_version_is_pinned():
    check_version("0.32.0")
    check_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 only .* this is vLLM 0\.33\.0"):
        check_version("0.33.0")


def test_import_kvslim_vllm_imports_no_vllm():
    code = "import sys, kvslim, kvslim.vllm, kvslim.vllm.spec; print(any(m.split('.')[0] == 'vllm' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_register_points_cpu_attn_at_kvslim_once():
    pytest.importorskip("vllm.version", reason="vLLM is not installed (make vllm builds .venv-vllm)")
    code = (
        "import kvslim.vllm as p\n"
        "p.register(); p.register()\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "print(E.CPU_ATTN.get_path())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "kvslim.vllm.backend.KvslimCPUBackend"
