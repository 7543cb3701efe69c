"""Config facts read from the format registry, the one integer check, and the options declared once."""

from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvslim import config
from kvslim.checks import check_int
from kvslim.config import MEAN_CENTER_FORMATS, OPTIONS, SPEC_KEYS, CacheConfig, parse_spec
from kvslim.formats import format_names, get_format


def test_mean_center_formats_come_from_the_registry():
    assert MEAN_CENTER_FORMATS == ("q4_0", "q5_0", "q8_0")
    assert set(MEAN_CENTER_FORMATS) == {n for n in format_names() if get_format(n).mean_center}
    for name in MEAN_CENTER_FORMATS:
        assert CacheConfig(kv_quantize="int4", k_quantize=name, mean_center="b.gguf").k_format == name


@pytest.mark.parametrize(
    "fmt,why",
    [
        ("int4", "its zero point already absorbs a per-channel mean"),
        ("q5_1", "its zero point already absorbs a per-channel mean"),
        ("fp8", "it does not quantize K with a symmetric (zero-point free) block format"),
        ("none", "it does not quantize K with a symmetric (zero-point free) block format"),
    ],
)
def test_mean_center_refusal_names_the_reason(fmt, why):
    with pytest.raises(ValueError) as e:
        CacheConfig(kv_quantize=fmt, mean_center="b.gguf")
    assert str(e.value) == (
        f"mean_center does not apply to K format {fmt!r}: {why}; it applies to q4_0, q5_0, q8_0"
    )


def test_check_int_messages():
    assert check_int("n", 3, minimum=1) == 3
    with pytest.raises(ValueError, match=r"^window must be >= 1 or None for an unbounded cache, got 0$"):
        check_int("window", 0, minimum=1, hint="or None for an unbounded cache")
    with pytest.raises(ValueError, match=r"^sink must be an integer >= 0, got True$"):
        check_int("sink", True, minimum=0)  # a bool is not an integer here
    with pytest.raises(ValueError, match=r"^sink must be an integer >= 0, got 2.0$"):
        check_int("sink", 2.0, minimum=0)
    with pytest.raises(ValueError, match=r"^offset must be an integer in \[0, 8\), got 8$"):
        check_int("offset", 8, minimum=0, below=8)
    with pytest.raises(ValueError, match=r"^group_size must be a positive integer, got 0$"):
        check_int("group_size", 0, minimum=1, expected="a positive integer")
    assert check_int("offset", 7, minimum=0, below=8) == 7


# -- the options, declared once (kvslim.config.OPTIONS) ---------------------------------------------------
README = Path(__file__).resolve().parents[1] / "README.md"


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def test_every_option_is_declared_once_on_its_field():
    assert [o.name for o in OPTIONS] == [f.name for f in fields(CacheConfig)]
    assert [o.default for o in OPTIONS] == [f.default for f in fields(CacheConfig)]
    assert OPTIONS[0].spec is None and list(SPEC_KEYS) == [o.spec for o in OPTIONS[1:]]
    assert all(
        o.flag is None or o.flag.startswith("--") and o.flag == o.flag.lower() and "_" not in o.flag
        for o in OPTIONS
    )  # kebab-case


def test_readme_lists_every_spec_key_and_flag():
    text = " ".join(README.read_text(encoding="utf-8").split())
    keys = text.split("Cache modes use one spec syntax everywhere:", 1)[1].split(" — e.g.", 1)[0]
    assert [k for k in _backticked(keys) if k != "auto" and "[" not in k] == list(SPEC_KEYS)
    flags = text.split("take the seed's flags (", 1)[1].split(")", 1)[0]
    assert sorted(_backticked(flags)) == sorted(o.flag for o in OPTIONS if o.flag)
    options = text.split("`SlimCache` options", 1)[1].split("`config=model.config`", 1)[0]
    named = {w for w in _backticked(options)}
    assert {o.name for o in OPTIONS} <= named, {o.name for o in OPTIONS} - named
    docstring = " ".join(config.__doc__.split())
    assert [
        k for k in re.findall(r"``(\w+)``", docstring.split("with keys", 1)[1].split("Examples", 1)[0])
    ] == list(SPEC_KEYS)


def test_slimcache_keywords_are_the_declared_options():
    from kvslim.cache.adapter import SlimCache

    params = inspect.signature(SlimCache.__init__).parameters
    assert [(p, params[p].default) for p in list(params)[1 : len(OPTIONS) + 1]] == [
        (o.name, o.default) for o in OPTIONS
    ]


#: a legal value other than the default for every option but the format
CHANGED = dict(
    k_quantize="q4_0",
    v_quantize="int2",
    sink=4,
    window=100,
    group_size=16,
    residual=32,
    v_group_size=32,
    mean_center="bias.gguf",
    positions="original",
    residual_dtype="bfloat16",
    rotate="k",
    pre_rope=True,
    varnorm="off",
    clip="v",
    codebook="v",
    keep_layers="0,-1",
    keep_format="k8v4",
)
#: what an option needs beside it to be legal (keep_format applies to the layers keep_layers names, clip to
#: an affine format, codebook to a 2- or 3-bit one)
NEEDS = dict(keep_format={"keep_layers": "0,-1"}, clip={"v_quantize": "int2"}, codebook={"v_quantize": "int2"})


SPEC_KEYS_BY_NAME = {o.name: o.spec for o in OPTIONS}


def test_every_spec_key_round_trips_a_value_other_than_its_default():
    assert set(CHANGED) == {o.name for o in OPTIONS[1:]}
    for opt in OPTIONS[1:]:
        value = CHANGED[opt.name]
        need = NEEDS.get(opt.name, {})
        c = CacheConfig(kv_quantize="q8_0", **need, **{opt.name: value})
        before = "".join(f",{SPEC_KEYS_BY_NAME[k]}={v}" for k, v in need.items())
        assert c.to_spec() == f"q8_0{before},{opt.spec}={int(value) if value is True else value}"
        assert parse_spec(c.to_spec()) == c
    every = CacheConfig(kv_quantize="q8_0", **CHANGED)
    assert parse_spec(every.to_spec()) == every


def test_validation_and_spec_messages_come_from_the_declaration():
    with pytest.raises(
        ValueError, match=r"^rotate must be one of auto, none, k, v, kv, fitted \(which encoded tensors"
    ):
        CacheConfig(rotate="x")
    with pytest.raises(
        ValueError, match=r"^pre_rope must be True, False or 'auto' \(store K before RoPE\), got 1$"
    ):
        CacheConfig(pre_rope=1)  # 1 == True, but not a bool
    with pytest.raises(ValueError, match=r"^window must be >= 1 or None for an unbounded cache, got 0$"):
        CacheConfig(window=0)
    with pytest.raises(ValueError, match=r"^k_quantize must be a format name, got 3$"):
        CacheConfig(k_quantize=3)
    keys = ", ".join(SPEC_KEYS)
    with pytest.raises(ValueError, match=rf"unknown key 'bogus'; keys: {keys}$"):
        parse_spec("int4,bogus=1")
    assert parse_spec("int4,window=none,v_group=,residual=AUTO,pre_rope=off") == CacheConfig(
        kv_quantize="int4", pre_rope=False
    )
    with pytest.raises(ValueError, match="group must be an integer, got 'auto'"):
        parse_spec("int4,group=auto")  # only the CLI resolves an automatic group


def test_cli_flags_come_from_the_declaration():
    from kvslim.cli.common import CACHE_FLAGS, add_cache_flags, cache_config_from_args

    parser = argparse.ArgumentParser()
    add_cache_flags(parser)
    assert {o.name: o.flag for o in OPTIONS if o.flag} == CACHE_FLAGS
    assert cache_config_from_args(parser.parse_args([])) == CacheConfig()
    argv, want = ["--kv-quantize", "int4"], {}
    for opt in OPTIONS[1:]:
        if opt.flag:
            value = CHANGED[opt.name]
            argv += [opt.flag] if value is True else [opt.flag, str(value)]  # a bool flag alone: on
            want[opt.name] = value
    assert cache_config_from_args(parser.parse_args(argv)) == CacheConfig(kv_quantize="int4", **want)


@pytest.mark.parametrize(
    "spec",
    ["none", "int4", "q4_0", "int4,residual=0", "q8_0,rotate=kv,sink=32", "k8v4", "none,k=int8,v=q4_0", "int4,sink=4,window=60",
     "int8,pre_rope=0,group=64,residual=64", "int4,keep_layers=last,keep_format=q8_0"],
)
def test_cache_flags_build_the_spec_back(spec):
    """``cache_flags`` (what ``kvslim bench --serve --pages`` starts a server with): the flags give the spec back."""
    from kvslim.cli.common import add_cache_flags, cache_config_from_args, cache_flags

    parser = argparse.ArgumentParser()
    add_cache_flags(parser)
    cfg = parse_spec(spec)
    assert cache_config_from_args(parser.parse_args(cache_flags(cfg))) == cfg


# -- presets and per-layer precision ---------------------------------------------------------------------


def test_presets_resolve_to_k_and_v_and_round_trip():
    from kvslim.formats import PRESETS, preset_names

    assert preset_names() == ["k8v4", "k4v3", "k4v2", "k3v2"]
    for name, p in PRESETS.items():
        c = parse_spec(name)
        assert (c.kv_quantize, c.k_format, c.v_format) == (name, p.k, p.v)
        assert c.to_spec() == name and parse_spec(c.to_spec()) == c
        assert get_format(p.k).bits >= get_format(p.v).bits  # K keeps at least V's bits
    c = parse_spec("k4v2,v=int3,sink=4,window=100")
    assert (c.k_format, c.v_format) == ("int4", "int3")  # v= overrides the preset's V half
    assert parse_spec(c.to_spec()) == c
    assert CacheConfig(kv_quantize="k8v4").replace(k_quantize="int4").k_format == "int4"
    with pytest.raises(
        ValueError,
        match=r"unknown KV format 'k9v9'; expected a format \(none, .*int3.*\) or a K/V preset \(k8v4, k4v3, k4v2, k3v2\)",
    ):
        parse_spec("k9v9")
    with pytest.raises(ValueError, match="unknown KV format 'k4v2'"):
        CacheConfig(k_quantize="k4v2")  # a preset names a pair, not one tensor's format
    with pytest.raises(ValueError, match="mean_center does not apply to K format 'int4'"):
        CacheConfig(kv_quantize="k4v2", mean_center="b.gguf")  # the preset's K half is what is checked


@pytest.mark.parametrize(
    "spec,layers,rest",
    [
        ("int2,keep_layers=first,last", (0, -1), {}),
        ("int2,keep_layers=0,1,-1,keep_format=int8", (0, 1, -1), {"keep_format": "int8"}),
        ("k4v2,keep_layers=-1,sink=4,window=100", (-1,), {"sink": 4, "window": 100}),
        ("int4,keep_layers=LAST , 2 ,keep_format=k8v4", (-1, 2), {"keep_format": "k8v4"}),
        ("int4,keep_layers=none", (), {}),
    ],
)
def test_keep_layers_spec(spec, layers, rest):
    c = parse_spec(spec)
    assert c.keep_layers == layers and all(getattr(c, k) == v for k, v in rest.items())
    assert parse_spec(c.to_spec()) == c
    if layers:
        assert f"keep_layers={','.join(map(str, layers))}" in c.to_spec()


def test_keep_layers_values_and_refusals():
    assert (
        CacheConfig(keep_layers=[0, -1])
        == CacheConfig(keep_layers="first,last")
        == CacheConfig(keep_layers=(0, -1))
    )
    assert CacheConfig(keep_layers=None).keep_layers == ()
    c = CacheConfig(kv_quantize="int2", keep_layers=(0, -1), keep_format="k8v4")
    assert c.kept_layers(30) == frozenset({0, 29}) and c.keep_formats == ("int8", "int4")
    assert c.layer_formats(0, 30) == ("int8", "int4") and c.layer_formats(5, 30) == ("int2", "int2")
    assert c.layer_formats(29, 30) == ("int8", "int4")
    with pytest.raises(
        ValueError,
        match=r"^keep_layers names layer 30, out of range: this model has 30 layers \(0..29, or -30..-1",
    ):
        CacheConfig(keep_layers=(0, 30)).kept_layers(30)
    with pytest.raises(ValueError, match="names layer -31, out of range"):
        CacheConfig(keep_layers=(-31,)).kept_layers(30)
    with pytest.raises(
        ValueError, match=r"^keep_format=int8 applies to the layers keep_layers names, and it names none"
    ):
        CacheConfig(keep_format="int8")
    with pytest.raises(ValueError, match="names layer 0 twice"):
        parse_spec("int4,keep_layers=0,first")
    with pytest.raises(
        ValueError, match=r"cache spec 'int4,keep_layers=0,x': keep_layers must be layer indices"
    ):
        parse_spec("int4,keep_layers=0,x")
    with pytest.raises(ValueError, match="keep_layers must be layer indices"):
        CacheConfig(keep_layers=(0, True))
    with pytest.raises(ValueError, match=r"'x' is not key=value"):
        parse_spec("int4,sink=4,x")  # only a list value continues over commas
    with pytest.raises(ValueError, match="unknown KV format 'int5'"):
        CacheConfig(keep_layers=(0,), keep_format="int5")


def test_cli_presets_and_keep_layers():
    from kvslim.cli.common import add_cache_flags, cache_config_from_args
    from kvslim.cli.errors import UserError

    parser = argparse.ArgumentParser()
    add_cache_flags(parser)
    help_text = " ".join(parser.format_help().split())
    for name in ("int3", "k8v4", "k4v3", "k4v2", "k3v2", "--kv-keep-layers", "--kv-keep-format"):
        assert name in help_text, name
    args = parser.parse_args(
        ["--kv-quantize", "k4v2", "--kv-keep-layers", "first,last", "--kv-keep-format", "int8"]
    )
    assert cache_config_from_args(args) == parse_spec("k4v2,keep_layers=0,-1,keep_format=int8")
    assert cache_config_from_args(parser.parse_args(["--kv-keep-layers=-1,0"])).keep_layers == (-1, 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-keep-layers", "one"])
    with pytest.raises(UserError, match="^--kv-keep-format=int8 applies to the layers"):
        cache_config_from_args(parser.parse_args(["--kv-keep-format", "int8"]))
