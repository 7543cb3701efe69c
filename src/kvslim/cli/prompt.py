"""The prompt in, for the CLI's text commands: read (--prompt or stdin), encoded, and the ids that end a text.

:func:`read_prompt` takes --prompt (refused unless it is UTF-8 text) or stdin (UTF-8, echo's trailing
newline dropped); :func:`encode` turns it into ids, in the tokenizer's chat template with ``--chat``;
:func:`eos_ids` are the ids a generation stops on (``kvslim sample``, ``kvslim serve``). Every user mistake
is one :class:`~kvslim.cli.common.UserError` line. This module knows tokenizers and text; it knows nothing
about caches, models' weights or generation.
"""

from __future__ import annotations

import argparse
import sys

from .common import UserError


def read_prompt(args: argparse.Namespace) -> str:
    """The text of --prompt (checked to be UTF-8), else stdin's (UTF-8, trailing newlines dropped)."""
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            # argv bytes that are not UTF-8 arrive as lone surrogates (U+DC80..U+DCFF = byte 0x80..0xFF)
            char = args.prompt[e.start]
            byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else repr(char)
            raise UserError(f"--prompt is not UTF-8 text ({byte} at character {e.start})") from None
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise UserError("no prompt: pass --prompt TEXT or pipe the prompt on stdin")
    buffer = getattr(sys.stdin, "buffer", None)
    try:
        text = buffer.read().decode("utf-8") if buffer is not None else sys.stdin.read()
    except UnicodeDecodeError as e:
        raise UserError(
            f"the prompt on stdin is not UTF-8 text ({e.reason} at byte {e.start}); pass UTF-8"
        ) from None
    # `echo TEXT | kvslim sample`: the newline is echo's, not the prompt's (it changes the answer).
    return text.rstrip("\r\n")


def encode(tokenizer, prompt: str, chat: bool):
    """The prompt as (1, T) ids; with ``chat``, wrapped in the tokenizer's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat: this model's tokenizer has no chat template; drop --chat")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            raise UserError(
                "the prompt is empty and the tokenizer has no BOS token to start from; pass --prompt TEXT"
            )
        import torch

        ids = torch.tensor([[bos]])
    return ids


def eos_ids(model, tokenizer) -> list[int]:
    """The token ids that end a text: the model's generation config's, its config's and the tokenizer's
    ``eos_token_id`` (an int or a list each), sorted, without repeats. ``kvslim sample`` and ``kvslim serve``
    stop on them."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)
