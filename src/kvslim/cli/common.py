"""Helpers shared by the subcommands: errors as one line, the model and cache flags, the checks
every command runs before loading a model (device, output paths, bias files, text), tables, JSON."""

from __future__ import annotations

import argparse
import math
import os

from ..config import DEFAULT_GROUP_SIZE, OPTIONS, SPEC_KEYS, CacheConfig, parse_layers
from ..formats import format_names, pair_names
from .errors import UserError, fail, say  # noqa: F401  (re-exported for the subcommands)

#: torch.Generator.manual_seed takes a 64-bit unsigned seed.
SEED_MAX = 2**64 - 1
#: --linears: the engine's route for the model's linear layers (kvslim.engine.linears.ROUTES; a test keeps them
#: equal, the CLI must not import torch to build its parser)
LINEAR_ROUTES = ("auto", "torch", "onednn", "packed", "mkl", "kvslim")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a local transformers directory, a .gguf file, or a hub id (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (default: float32)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="hash every file of the embedded model's converted copy before loading it "
        "(damage is otherwise found by sizes, the weights' fingerprint and failed loads)",
    )


def load_model_from_args(args: argparse.Namespace, *, kvslim_attention: bool = False):
    """``(model, tokenizer)`` for the model flags (a one-line ValueError on any failure).

    kvslim_attention: switch the model to the ``kvslim`` attention (:func:`kvslim.enable`): decode steps
    read the compressed codes directly (prefill chunks are plain sdpa); the materializing path gives the
    same numbers to float rounding (tests/test_attention.py), slower.

    Started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment): joins the process group first (gloo on
    the CPU, NCCL on CUDA, a 60 s timeout: :func:`kvslim.distributed.init_from_env`), then loads the model
    tensor parallel, each rank holding a block of its KV heads; every rank runs the command alike and
    :func:`is_main_rank` alone prints."""
    from .. import enable
    from ..models import load_model

    if distributed_run():
        from .. import distributed

        device = distributed.init_from_env(args.device)  # ValueError for a device the ranks cannot run on
        model, tokenizer = load_model(
            args.model, device=device, dtype=args.dtype, verify=args.verify, tensor_parallel=True
        )
    else:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, verify=args.verify)
    return (enable(model) if kvslim_attention else model), tokenizer


def distributed_run() -> bool:
    """Whether this process is one of several started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment;
    known before any process group is joined)."""
    from ..distributed import env_world_size

    return env_world_size() > 1


def is_main_rank() -> bool:
    """Whether this process prints and writes files: always alone, rank 0 under ``torchrun``."""
    from ..distributed import env_rank

    return not distributed_run() or env_rank() == 0


def check_model_args(args: argparse.Namespace) -> None:
    """Cheap checks of --model and --device, before seconds of imports and loading."""
    from ..models import resolve_spec

    resolve_spec(args.model)  # a missing path or package: one line now
    check_device(args.device)


def check_device(text: str) -> None:
    """UserError unless ``text`` names a torch device that can hold tensors on this machine."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {text}: not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None
    if device.type == "meta":
        raise UserError("--device meta holds shapes but no data: a model cannot run on it; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {text}: CUDA is not available in this torch build or on this machine")
    try:
        torch.empty(1, device=device)
    except Exception as e:  # RuntimeError, AssertionError ("not compiled with ..."), AttributeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first.split(". ")[0].rstrip(".")  # torch's dispatcher errors run on for sentences
        raise UserError(f"--device {text}: not available on this machine ({first})") from None


def check_output(flag: str, path: str | None) -> None:
    """UserError unless ``path`` (an output file) can be written: its directory exists and it is
    not a directory. Run before the model loads, so a typo costs nothing."""
    if path is None:
        return
    from ..atomic import WriteError, check_writable_target

    try:
        check_writable_target(path, flag)
    except WriteError as e:
        raise UserError(str(e)) from None


def check_input_file(flag: str, path: str | None, hint: str = "") -> None:
    if path is not None and not os.path.isfile(path):
        what = "is a directory, expected a file" if os.path.isdir(path) else "no such file"
        raise UserError(f"{flag} {path}: {what}{hint}")


def check_bias_file(flag: str, path: str | None) -> None:
    """UserError unless ``path`` is a readable, well-formed bias file (shapes are checked against the
    model later, by SlimCache)."""
    if path is None:
        return
    check_input_file(flag, path, " (make one with `kvslim calibrate`)")
    from ..calibration.biasfile import read_layers

    try:
        read_layers(path)
    except ValueError as e:
        raise UserError(f"{flag}: {e}") from None


def read_text_file(flag: str, path: str) -> str:
    """A UTF-8 text file's contents; UserError for a missing, non-UTF-8 or empty file."""
    check_input_file(flag, path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise UserError(f"{flag} {path}: the file is empty")
    return text


def seed_int(text: str) -> int:
    """argparse type of --seed: an integer in [0, 2^64 - 1] (what torch's generator takes)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {SEED_MAX}], got {text!r}") from None
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {SEED_MAX}], got {text}")
    return value


def bias_cache_maker(model, args: argparse.Namespace, *, static_len: int | None = None):
    """``make_cache(CacheConfig) -> SlimCache`` for ``model`` that hands every bias file the model's
    fingerprint (a file calibrated for another model is an error unless --kv-mean-center-any-model).

    Under ``torchrun`` the cache is this rank's (:func:`kvslim.distributed.rank_cache`): its KV heads, the
    bias file cut to them. ``static_len``: a :class:`~kvslim.StaticSlimCache` holding at most that many tokens
    (``--compile``) instead."""
    from ..cache.adapter import SlimCache
    from ..cache.static_adapter import StaticSlimCache

    fingerprint: list[str] = []
    sharded = distributed_run()

    def make(cfg: CacheConfig):
        kwargs = {}
        if cfg.mean_center is not None:
            if not fingerprint:
                from ..calibration.fingerprint import model_fingerprint

                fingerprint.append(model_fingerprint(model))
            kwargs = dict(model_fingerprint=fingerprint[0], allow_other_model=args.kv_mean_center_any_model)
        try:
            if sharded:
                from ..distributed import rank_cache

                return rank_cache(model, **cfg.to_dict(), **kwargs)  # what SlimCache.from_config passes
            if static_len is not None:
                return StaticSlimCache.from_config(cfg, config=model.config, max_cache_len=static_len, **kwargs)
            return SlimCache.from_config(cfg, config=model.config, **kwargs)
        except ValueError as e:
            raise ValueError(_dtype_hint(str(e), model)) from None

    return make


def _dtype_hint(message: str, model) -> str:
    """A fingerprint mismatch under float16 may be the dtype's doing: its weights, rounded twice, fingerprint
    differently from the float32 / bfloat16 ones a bias file is usually calibrated with. Say so."""
    import torch

    if "calibrated for another model" not in message or getattr(model, "dtype", None) != torch.float16:
        return message
    return (
        f"{message} (this model runs in float16, whose fingerprint differs from the same model's in float32 or "
        f"bfloat16: calibrate with --dtype float16, or pass --kv-mean-center-any-model if the file is for this model)"
    )


def add_any_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-mean-center-any-model",
        action="store_true",
        help="use a bias file calibrated for another model (a warning instead of an error)",
    )


#: How a --kv-pre-rope style flag (a ``bool`` option) spells its values; the flag alone is ``on``.
_SWITCH = {"on": True, "off": False}


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The seed's flag surface for one cache mode: every option declared with a flag
    (:data:`kvslim.config.OPTIONS`), the StreamingLLM ones first."""
    flagged = sorted((o for o in OPTIONS if o.flag), key=lambda o: not o.flag.startswith("--streaming-llm"))
    for opt in flagged:
        kwargs = dict(default=opt.flag_default, help=opt.flag_help)
        if opt.metavar:
            kwargs["metavar"] = opt.metavar
        if opt.kind == "int":
            kwargs["type"] = _auto_or_int if opt.flag_auto else int
        elif opt.kind == "format":
            kwargs["choices"] = format_names()
        elif opt.kind == "pair":
            kwargs["choices"] = pair_names()
        elif opt.kind == "layers":
            kwargs["type"] = _layers
        elif opt.kind == "choice":
            kwargs["choices"] = opt.choices
        elif opt.kind == "bool":
            kwargs.update(nargs="?", const="on", choices=("auto", *_SWITCH))
        parser.add_argument(opt.flag, **kwargs)
    add_any_model_flag(parser)


def spec_keys_help() -> str:
    """The spec keys, as a --config help lists them."""
    return ", ".join(SPEC_KEYS)


def _layers(value: str) -> tuple[int, ...]:
    """A flag value: a layer list (:func:`kvslim.config.parse_layers`)."""
    try:
        return parse_layers(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("keep_layers must be", "expected")) from None


def _auto_or_int(value: str):
    """A flag value: an integer or ``auto``."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def auto_group_size(group, window, residual):
    """``--kv-group-size auto``: 32, or for a window shorter than two groups of 32 the largest power of two
    that is at most half the window (and divides an explicit ``--kv-residual``), so that the window is mostly
    encoded; an explicit value is returned as given."""
    if group != "auto":
        return group
    if not isinstance(window, int) or window >= 2 * DEFAULT_GROUP_SIZE:
        return DEFAULT_GROUP_SIZE
    g = 1
    while 2 * g <= window // 2:
        g *= 2
    while g > 1 and isinstance(residual, int) and residual % g:
        g //= 2
    return g


def cache_config_from_args(args: argparse.Namespace) -> CacheConfig:
    """Build the validated CacheConfig from the cache flags; a bad value is a UserError naming the flag
    (the library's message names the field: ``sink must be >= 0`` -> ``--streaming-llm-sink must be >= 0``)."""
    values = {}
    for opt in OPTIONS:
        if opt.flag:
            value = getattr(args, _dest(opt.flag))
            values[opt.name] = _SWITCH.get(value, value) if opt.kind == "bool" else value
    values["group_size"] = auto_group_size(values["group_size"], values["window"], values["residual"])
    try:
        return CacheConfig(**values)
    except ValueError as e:
        raise UserError(flag_names(str(e))) from None


def cache_flags(config: CacheConfig) -> list[str]:
    """The cache flags that build ``config`` (:func:`cache_config_from_args`'s inverse: a server started with them
    has ``config`` for its cache): every flagged option whose value is not its flag's default."""
    out: list[str] = []
    for opt in OPTIONS:
        value = getattr(config, opt.name) if opt.flag else None
        if value is None or value == opt.flag_default or (opt.kind == "layers" and not value):
            continue
        if opt.kind == "bool":
            value = {True: "on", False: "off"}.get(value, value)
        elif opt.kind == "layers":
            value = ",".join(str(i) for i in value)
        out += [opt.flag, str(value)]
    return out


def _dest(flag: str) -> str:
    """argparse's attribute for ``flag``."""
    return flag.lstrip("-").replace("-", "_")


#: CacheConfig's field names as the cache flags spell them (for messages).
CACHE_FLAGS = {o.name: o.flag for o in OPTIONS if o.flag}


def flag_names(message: str) -> str:
    """``message`` with CacheConfig's field names (``sink``, ``group_size=32``) replaced by the flags."""
    import re

    pattern = r"(?<![\w-])(" + "|".join(sorted(CACHE_FLAGS, key=len, reverse=True)) + r")(?=\s+must\b|=)"
    return re.sub(pattern, lambda m: CACHE_FLAGS[m.group(1)], message)


def format_table(headers: list[str], rows: list[list], floatfmt: str = ".4g") -> str:
    """A plain aligned text table (numbers right-aligned)."""

    def cell(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else format(v, floatfmt)
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    numeric = [
        all(isinstance(r[i], (int, float)) for r in rows) if rows else False for i in range(len(headers))
    ]

    def line(cells):
        return "  ".join(
            c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in text]
    return "\n".join(out)


def write_json(path: str, obj, flag: str = "--json") -> None:
    """Write ``obj`` as strict JSON, atomically (:mod:`kvslim.atomic`). A float that is not a number
    (NaN, inf) is written as null, and a stderr note says which values and why."""
    from ..atomic import write_json as atomic_write_json

    clean, bad = json_safe(obj)
    atomic_write_json(path, clean, what=flag)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        say(
            f"kvslim: note: {flag} {path}: {len(bad)} value(s) are not numbers (NaN or infinite, e.g. a "
            f"ratio with nothing to divide by) and were written as null: {shown}"
        )


def json_safe(obj, where: str = "") -> tuple[object, list[str]]:
    """``obj`` with every non-finite float replaced by None, and the paths of those values."""
    bad: list[str] = []

    def walk(value, path: str):
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(path or "(top)")
            return None
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return value

    return walk(obj, where), bad
