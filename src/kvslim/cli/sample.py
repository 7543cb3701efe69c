"""``kvslim sample``: stream text from a model through a compressed, bounded KV cache.

Parsing and printing only: the model comes from :func:`kvslim.models.load_model`, the cache from
:meth:`kvslim.SlimCache.from_config`, the tokens from :func:`kvslim.generate.generate`.

stdout gets the generated text and nothing else (flushed per token); stderr gets one banner line
before and a report after, also after Ctrl-C (exit 130) and SIGTERM (exit 143). A reader of stdout
that leaves (``| head``) stops the generation, and the report still goes to stderr (exit 0); if
stderr's reader has gone too (``2>&1 | head``) the exit code is 2. --report-json and --rss-log are
written atomically (the log replaces its target when the run ends).

Under ``torchrun`` (tensor parallel, see :func:`kvslim.cli.common.load_model_from_args`) every rank runs the
same decode loop with the same seed (drawn on rank 0 when --seed is not given), so every rank draws the same
tokens; rank 0 alone prints the text, the banner and the report and writes the files, and the report's bytes
are the whole cache's, summed over the ranks (:func:`kvslim.distributed.reduce_report`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from .common import (
    UserError,
    add_cache_flags,
    add_model_flags,
    bias_cache_maker,
    cache_config_from_args,
    check_bias_file,
    check_model_args,
    check_output,
    distributed_run,
    is_main_rank,
    load_model_from_args,
    seed_int,
    write_json,
)
from .errors import interrupt_code, say, silence

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (embedded)"
_HASH_MOD = (1 << 61) - 1  # a prime below 2^62: what kvslim.distributed.agree compares
RSS_LOG_EVERY = 500


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    parser.add_argument(
        "--prompt",
        default=None,
        metavar="TEXT",
        help="the prompt (default: stdin, trailing newlines dropped)",
    )
    parser.add_argument(
        "--tokens", type=int, default=128, metavar="N", help="tokens to generate (default: 128)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        metavar="T",
        help="sampling temperature, 0 = greedy (default: 0.7)",
    )
    parser.add_argument(
        "--top-p", type=float, default=0.95, metavar="P", help="nucleus sampling mass (default: 0.95)"
    )
    parser.add_argument(
        "--seed",
        type=seed_int,
        default=None,
        metavar="S",
        help="seed for reproducible sampling (0 .. 2^64-1)",
    )
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past end-of-sequence tokens (exactly N tokens)",
    )
    add_cache_flags(parser)
    parser.add_argument(
        "--allow-beyond-context",
        action="store_true",
        help="without StreamingLLM, generate past the model's context length (a warning, not an error)",
    )
    parser.add_argument(
        "--prompt-cache",
        default=None,
        metavar="FILE",
        help="keep the prompt's compressed cache in FILE (safetensors): if FILE is missing, the prompt (all but "
        "its last token) is prefilled and saved there before generating; if present, it is loaded, the prompt "
        "must start with the tokens it holds, and only the rest is prefilled (as llama.cpp's --prompt-cache and "
        "mlx_lm.cache_prompt). The cache flags must be the ones the file was saved with",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode with a compiled step (torch.compile) on a fixed-shape StaticSlimCache; the first step "
        "compiles (about a minute on CPU), the report says how long (docs/compile.md)",
    )
    parser.add_argument("--report-json", default=None, metavar="FILE", help="write the final report as JSON")
    parser.add_argument(
        "--rss-log",
        default=None,
        metavar="FILE",
        help=f"write (step, rss_bytes) every {RSS_LOG_EVERY} tokens (CSV)",
    )


def run(args: argparse.Namespace) -> int:
    cache_config = cache_config_from_args(args)  # ValueError -> one line, before any slow work
    _check_args(args)
    saved_cache = _check_prompt_cache(args, cache_config)
    prompt = _read_prompt(args)

    from ..atomic import AtomicFile
    from ..generate import generate
    from ..models import check_cache_writable, is_converted
    from ..shapes import ModelShapes
    from ..textstream import StreamDecoder

    if args.model is None and not is_converted():
        check_cache_writable()  # a read-only cache: one error line, not a notice and then an error
        say("kvslim: converting the embedded model once (about 25 s); later starts take seconds")
    model, tokenizer = load_model_from_args(args, kvslim_attention=True)
    input_ids = _encode(tokenizer, prompt, args.chat).to(model.device)  # (1, T)
    shapes = ModelShapes.from_config(model.config)
    _check_context(args, cache_config, input_ids.shape[1], shapes.max_position_embeddings)
    no_quantizing = _nothing_quantized(args, cache_config, input_ids.shape[1])

    if args.prompt_cache:
        cache, feed, prompt_cache = _prompt_cache(args, model, input_ids, cache_config, saved_cache)
    else:
        static_len = input_ids.shape[1] + args.tokens if args.compile else None
        cache, feed, prompt_cache = bias_cache_maker(model, args, static_len=static_len)(cache_config), input_ids, None
    compiled = None
    if args.compile:
        from ..compiled import compile_decode

        compiled = compile_decode(model)
        say("kvslim: compiled decode step on a StaticSlimCache (the first step compiles)")
    say(_banner(args, cache_config, model, shapes.head_dim, quantizes=no_quantizing is None, cache=cache))
    if no_quantizing:
        say(f"kvslim: warning: {no_quantizing}")
    if prompt_cache:
        say(f"kvslim: {prompt_cache['note']}")

    from ..distributed import agree, reduce_report, shared_seed

    sharded, main_rank = distributed_run(), is_main_rank()
    eos = None if args.ignore_eos else _eos_ids(model, tokenizer)
    gen = generate(
        model,
        feed,  # the prompt, or what the --prompt-cache file does not hold
        cache,
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=shared_seed(args.seed) if args.temperature > 0 else args.seed,  # every rank the same draws
        eos_token_id=eos,
    )
    decoder = StreamDecoder(tokenizer, input_ids[0].tolist())
    rss_log = AtomicFile(args.rss_log, "w", what="--rss-log") if args.rss_log and main_rank else None
    code = 0
    out = sys.stdout if main_rank else None  # the other ranks decode too (the same tokens), silently
    drawn = 0  # a running hash of the tokens: every rank must have drawn the same (checked at the end)
    try:
        if rss_log:
            rss_log.write("step,rss_bytes\n")
        for event in gen:
            drawn = (drawn * 1_000_003 + event.tokens[0] + 1) % _HASH_MOD
            piece = decoder.push(event.tokens[0])
            if piece and out is not None:
                try:
                    out.write(piece)
                    out.flush()
                except BrokenPipeError:  # `kvslim sample ... | head`: the reader left; stop, still report
                    out = None
                    silence(sys.stdout)  # no second error at exit
                    if not sharded:
                        break
                    # under torchrun the other ranks decode on, and every step is a collective: keep in step
                except OSError as e:  # `> FILE` on a full disk: the error must say it was stdout
                    silence(sys.stdout)
                    raise _stdout_error(e) from None
            if rss_log and event.step % RSS_LOG_EVERY == 0:
                rss_log.write(f"{event.step},{current_rss_bytes()}\n")
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: stop, still report
        code = interrupt_code(e)
    finally:
        gen.close()
        if rss_log and not rss_log.closed:
            try:
                rss_log.write(f"{gen.stats.new_tokens},{current_rss_bytes()}\n")
                rss_log.commit()
            finally:
                rss_log.discard()  # a no-op after a commit; removes the temporary file after a failure
    if out is not None:
        try:
            out.write(decoder.flush() + "\n")
            out.flush()
        except BrokenPipeError:
            if not sharded:
                raise
            silence(sys.stdout)  # the ranks still sum the report's bytes together below
        except OSError as e:
            silence(sys.stdout)
            raise _stdout_error(e) from None

    if code == 0 and sharded and not agree(drawn):  # a collective: never after an interrupt
        raise ValueError(
            "the ranks drew different tokens, so the text above is rank 0's alone: their logits differ "
            "(a collective that is not bit-identical on every rank?)"
        )
    report = build_report(cache, gen.stats, args=args, interrupted=code != 0)
    if compiled is not None:
        report["compile"] = {"graphs": compiled.compiles, "compile_s": compiled.compile_s, "steps": compiled.steps}
    if prompt_cache:
        report["prompt_cache"] = {k: v for k, v in prompt_cache.items() if k != "note"}
    if code == 0:
        report = reduce_report(report)  # the whole cache, summed over the ranks (a collective; alone: as is)
    elif sharded:  # not summed after an interrupt: a peer may be gone, and the sum would wait for it
        report["bytes_of_rank"] = 0
    if not main_rank:
        return code
    say(format_report(report))  # if stderr's reader has gone too, main() exits 2
    if args.report_json:
        write_json(args.report_json, report, flag="--report-json")
    return code


# ---------------------------------------------------------------------------------------------
# checks and input


def _stdout_error(e: OSError) -> OSError:
    """A failed write of the text as an error naming stdout ("stdout: No space left on device")."""
    return OSError(e.errno, f"{e.strerror or e}; the text on stdout is incomplete", "stdout")


def _check_args(args: argparse.Namespace) -> None:
    """Cheap checks of every flag and file, before the model loads."""
    if args.tokens < 1:
        raise UserError(f"--tokens must be >= 1, got {args.tokens}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}")
    check_bias_file("--kv-mean-center", args.kv_mean_center)
    if args.compile and args.prompt_cache:
        raise UserError("--compile and --prompt-cache do not combine yet (a StaticSlimCache is not saved)")
    if args.compile and distributed_run():
        raise UserError("--compile is not available under torchrun yet")
    check_output("--report-json", args.report_json)
    check_output("--rss-log", args.rss_log)
    check_model_args(args)


#: What to do about a --prompt-cache file the continuation rule refuses, by CannotContinue.kind (the
#: "damaged" and "tokens" messages say it themselves).
_PROMPT_CACHE_FIX = {
    "model": "use the model it was saved from, or another --prompt-cache file",
    "dtype": "pass the --dtype it was saved with, or another --prompt-cache file",
    "settings": "pass the cache flags it was saved with, or another --prompt-cache file",
}


def _refused(e) -> UserError:
    """A --prompt-cache file the continuation rule refuses: one line, the rule's reason and the fix."""
    fix = _PROMPT_CACHE_FIX.get(e.kind)
    return UserError(f"{e}: {fix}" if fix else str(e))


def _check_prompt_cache(args: argparse.Namespace, cache_config):
    """Before the model loads: an existing --prompt-cache file must have been saved with these cache flags
    (its header and token ids are read; its tensors later), a new one must be writable. Returns the file's
    :class:`~kvslim.promptcache.SavedCache`, or None when it is to be created."""
    path = args.prompt_cache
    if path is None:
        return None
    if distributed_run():
        raise UserError(
            "--prompt-cache is not available under torchrun (each rank holds a part of the cache)"
        )
    if not os.path.exists(path):
        check_output("--prompt-cache", path)
        return None
    from ..promptcache import CannotContinue, SavedCache, check_continuation

    try:
        saved = SavedCache.read(path)
        check_continuation(saved, cache_config=cache_config, where=f"--prompt-cache {path}")
    except CannotContinue as e:
        raise _refused(e) from None
    return saved


def _prompt_cache(args, model, input_ids, cache_config, saved):
    """``(cache, tokens still to feed (1, n), report entry)`` for --prompt-cache FILE.

    No file: prefill every prompt token but the last into a new cache and save it with their ids (the last
    token is fed by the generation, which needs its logits; llama.cpp re-evaluates it the same way). A file:
    the continuation rule (:func:`kvslim.promptcache.check_continuation`: this model, its dtype, these cache
    flags, a prompt that starts with the file's tokens) before its tensors are read, then load it and feed
    only the rest."""
    import torch

    from ..calibration.fingerprint import model_fingerprint
    from ..generate import prefill
    from ..promptcache import CannotContinue, check_continuation, load

    path, n_prompt = args.prompt_cache, input_ids.shape[1]
    fingerprint = model_fingerprint(model)
    if saved is None:
        cache = bias_cache_maker(model, args)(cache_config)
        head = input_ids[:, :-1]  # (1, T - 1)
        if head.shape[1]:
            with torch.inference_mode():
                prefill(model, head, cache)
        cache.save(path, token_ids=head.cpu(), model_fingerprint=fingerprint)
        note = f"--prompt-cache {path}: saved the prompt's first {head.shape[1]} of {n_prompt} tokens"
        return (
            cache,
            input_ids[:, -1:],
            {"file": path, "reused_tokens": 0, "saved_tokens": head.shape[1], "note": note},
        )
    try:
        n = check_continuation(
            saved,
            input_ids,
            cache_config=cache_config,
            model_fingerprint=fingerprint,
            dtype=model.dtype,
            where=f"--prompt-cache {path}",
        )
    except CannotContinue as e:
        raise _refused(e) from None
    restored = load(
        path,
        config=model.config,
        model_fingerprint=fingerprint,
        mean_center=args.kv_mean_center,
        device=model.device,
        cache_config=cache_config,
        allow_other_model=args.kv_mean_center_any_model,
    )  # ValueError (one line): the checks that need the tensors (checksum, shapes, levers, the bias)
    note = f"--prompt-cache {path}: reused {n} of the prompt's {n_prompt} tokens; prefilling {n_prompt - n}"
    return (
        restored.cache,
        input_ids[:, n:],
        {"file": path, "reused_tokens": n, "saved_tokens": 0, "note": note},
    )


def _read_prompt(args: argparse.Namespace) -> str:
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


def _encode(tokenizer, prompt: str, chat: bool):
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


def _check_context(args, cache_config, prompt_tokens: int, context: int | None) -> None:
    """Without StreamingLLM, positions past the model's trained context are an error (or a warning
    with --allow-beyond-context). With it, they are the point."""
    if context is None or cache_config.window is not None:
        return
    needed = prompt_tokens + args.tokens
    if needed <= context:
        return
    message = (
        f"a {prompt_tokens}-token prompt plus --tokens {args.tokens} needs {needed} positions, beyond the "
        f"model's context of {context}"
    )
    if not args.allow_beyond_context:
        raise UserError(
            f"{message}; bound the cache with --streaming-llm-window M (StreamingLLM), lower --tokens, "
            f"or pass --allow-beyond-context to generate past it anyway"
        )
    say(f"kvslim: warning: {message}; quality degrades past it")


def _nothing_quantized(args, cache_config, prompt_tokens: int) -> str | None:
    """Why this run quantizes nothing although a lossy format was asked for (no token will ever
    leave the full-precision residual), or None."""
    c = cache_config
    if c.k_format == "none" and c.v_format == "none":
        return None
    start = c.residual_tokens + c.group_size  # tokens held (beyond the sinks) when the first group is encoded
    seen = prompt_tokens + args.tokens - 1  # the last token is generated, never stored
    held = seen - c.sink if c.window is None else min(seen - c.sink, c.window)
    if held >= start:
        return None
    why = (
        f"the window holds {c.window} tokens"
        if c.window is not None and c.window < start
        else (
            f"this run stores at most {max(held, 0)}"
            + (f" beyond the {c.sink} sinks" if c.sink else "")
            + f" (prompt {prompt_tokens} + --tokens {args.tokens}, the last token never stored)"
        )
    )
    return (
        f"nothing will be quantized: the newest {c.residual_tokens} tokens stay at full precision and older "
        f"ones are encoded {c.group_size} at a time, so quantizing starts at {start} stored tokens, "
        f"but {why}; lower --kv-group-size / --kv-residual"
    )


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


# ---------------------------------------------------------------------------------------------
# banner and report


def _bits_for(fmt: str, role: str, model, head_dim: int, cache_config) -> float:
    import torch

    from ..formats import make_codec

    if fmt == "none":
        return float(torch.finfo(model.dtype).bits)
    codec = make_codec(fmt, role, group_size=cache_config.group_size, v_group_size=cache_config.v_group_size)
    return codec.bits_per_element(head_dim)


def _banner(args, cache_config, model, head_dim: int, quantizes: bool = True, cache=None) -> str:
    c = cache_config
    k_bits = _bits_for(c.k_format, "k", model, head_dim, c)
    v_bits = _bits_for(c.v_format, "v", model, head_dim, c)
    parts = [f"K {c.k_format} ({k_bits:.2f} bits/elem), V {c.v_format} ({v_bits:.2f} bits/elem)"]
    if c.k_format != "none" or c.v_format != "none":
        parts.append(
            f"group {c.group_size}/residual {c.residual_tokens}"
            + (" (auto)" if c.residual == "auto" else "")
            + ("" if quantizes else " (nothing quantized in this run)")
        )
    if c.window is None:
        parts.append("unbounded" + (f", first {c.sink} at full precision" if c.sink else ""))
    else:
        parts.append(f"sink {c.sink}/window {c.window}")
    if cache is not None and cache.rotate != "none":
        parts.append(f"{cache.rotate.upper()} Hadamard-rotated")
    if cache is not None and cache.pre_rope:
        parts.append("K pre-RoPE")
    if c.mean_center:
        parts.append(f"K mean-centered ({os.path.basename(c.mean_center)})")
    model_name = DEFAULT_MODEL_NAME if args.model is None else args.model
    dtype = str(model.dtype).replace("torch.", "")
    return f"kvslim sample | model {model_name} | cache {', '.join(parts)} | {model.device} {dtype}"


def build_report(cache, stats, *, args=None, interrupted: bool = False) -> dict:
    """The cache's report plus timings and peak RSS, as plain JSON-able values (NaN -> None)."""
    report = dict(cache.report())
    report.update(
        prompt_tokens=stats.prompt_tokens,
        new_tokens=stats.new_tokens,
        prefill_s=stats.prefill_s,
        decode_s=stats.decode_s,
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        peak_rss_bytes=peak_rss_bytes(),
        interrupted=interrupted,
    )
    if args is not None:
        report.update(
            model=args.model or DEFAULT_MODEL_NAME,
            device=args.device,
            dtype=args.dtype,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
        )
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in report.items()}


def format_report(r: dict) -> str:
    stored = f"{r['tokens_stored']}"
    if r.get("capacity") is not None:
        cfg = r.get("config") or {}
        stored += f" (cap sink+window = {cfg.get('sink', '?')}+{cfg.get('window', '?')} = {r['capacity']})"
    fp16 = r["fp16_full_cache_bytes"]
    ratio = f"{r['cache_bytes'] / fp16:.3f}x" if fp16 else "n/a"
    live = r.get("live_bytes")
    live = (
        f" (stored tokens {_mib(live)}, the rest preallocated)" if live and live != r["cache_bytes"] else ""
    )
    ranks = f" across {r['ranks']} ranks" if r.get("ranks", 1) > 1 else ""
    if r.get("bytes_of_rank") is not None:
        ranks = f" on rank {r['bytes_of_rank']} alone (interrupted: not summed over the ranks)"
    lines = [
        ("interrupted | " if r.get("interrupted") else "")
        + f"tokens seen {r['tokens_seen']} | tokens stored {stored}",
        f"cache {_mib(r['cache_bytes'])}{ranks}{live} | fp16 full cache {_mib(fp16)} | ratio {ratio}",
        f"prefill {r['prompt_tokens']} tokens at {_rate(r['prefill_tokens_per_s'])} | "
        f"generated {r['new_tokens']} tokens, decode at {_rate(r['decode_tokens_per_s'])} | "
        f"peak RSS {_mib(r['peak_rss_bytes'])}" + (" (rank 0)" if ranks else ""),
    ]
    c = r.get("compile")
    if c:  # the decode rate above includes the compiling first step
        lines.append(f"compiled decode step: {c['graphs']} graph(s) compiled in {c['compile_s']:.1f} s, {c['steps']} compiled steps")
    return "\n".join("kvslim: " + line for line in lines)


def _mib(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _rate(x) -> str:
    return "n/a tok/s" if x is None else f"{x:.1f} tok/s"


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc; elsewhere the peak, the best portable stand-in)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
