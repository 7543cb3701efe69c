"""``kvslim sample``: stream text from a model through a compressed, bounded KV cache.

Parsing and printing only: the model comes from :func:`kvslim.models.load_model`, the cache from
:meth:`kvslim.SlimCache.from_config`, the tokens from :func:`kvslim.generate.generate`. This module holds the
flags and the run's order; the rest is beside it: the prompt in (:mod:`.prompt`), the checks of the flags
(:mod:`.sample_checks`), the --prompt-cache flow (:mod:`.prompt_cache`), the banner, report and RSS
(:mod:`.sample_report`).

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
import sys

from .common import (
    LINEAR_ROUTES,
    add_cache_flags,
    add_model_flags,
    bias_cache_maker,
    cache_config_from_args,
    distributed_run,
    is_main_rank,
    load_model_from_args,
    seed_int,
    write_json,
)
from .errors import interrupt_code, say, silence
from .prompt import encode, eos_ids, read_prompt
from .prompt_cache import check_prompt_cache, prompt_cache
from .sample_checks import check_args, check_context, nothing_quantized
from .sample_report import DEFAULT_MODEL_NAME, banner, build_report, current_rss_bytes, format_report

__all__ = ["DEFAULT_MODEL_NAME", "RSS_LOG_EVERY", "build_report", "configure", "format_report", "run"]

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
    parser.add_argument(
        "--linears", choices=LINEAR_ROUTES, default="auto",
        help="which library runs the model's linear layers: auto (default: the fastest at one row of torch, onednn "
        "and kvslim, timed at start-up; torch under torchrun, where every rank must round alike), torch, onednn, "
        "packed, mkl or kvslim (kvslim's own kernel; docs/performance.md, \"kvslim's linear layers\"). Not with "
        "--compile, whose graph runs torch's",
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
    check_args(args)
    saved_cache = check_prompt_cache(args, cache_config)
    prompt = read_prompt(args)

    from ..atomic import AtomicFile
    from ..generate import generate
    from ..models import check_cache_writable, is_converted
    from ..shapes import ModelShapes
    from ..textstream import StreamDecoder

    if args.model is None and not is_converted():
        check_cache_writable()  # a read-only cache: one error line, not a notice and then an error
        say("kvslim: converting the embedded model once (about 25 s); later starts take seconds")
    model, tokenizer = load_model_from_args(args, kvslim_attention=True)
    input_ids = encode(tokenizer, prompt, args.chat).to(model.device)  # (1, T)
    shapes = ModelShapes.from_config(model.config)
    check_context(args, cache_config, input_ids.shape[1], shapes.max_position_embeddings)
    no_quantizing = nothing_quantized(args, cache_config, input_ids.shape[1])

    if args.prompt_cache:
        cache, feed, reused = prompt_cache(args, model, input_ids, cache_config, saved_cache)
    else:
        static_len = input_ids.shape[1] + args.tokens if args.compile else None
        cache, feed, reused = bias_cache_maker(model, args, static_len=static_len)(cache_config), input_ids, None
    route = None
    if not args.compile:
        from ..engine.linears import Linears

        asked = "torch" if args.linears == "auto" and distributed_run() else args.linears
        route = Linears(model, asked, batch_hint=1, single=True)  # an unusable route: one line (ValueError)
    compiled = None
    if args.compile:
        from ..compiled import compile_decode

        compiled = compile_decode(model)
        say("kvslim: compiled decode step on a StaticSlimCache (the first step compiles)")
    say(banner(args, cache_config, model, shapes.head_dim, quantizes=no_quantizing is None, cache=cache))
    if route is not None and route.route != "torch":
        say(f"kvslim: {route}")
    if no_quantizing:
        say(f"kvslim: warning: {no_quantizing}")
    if reused:
        say(f"kvslim: {reused['note']}")

    from ..distributed import agree, reduce_report, shared_seed

    sharded, main_rank = distributed_run(), is_main_rank()
    eos = None if args.ignore_eos else eos_ids(model, tokenizer)
    gen = generate(
        model,
        feed,  # the prompt, or what the --prompt-cache file does not hold
        cache,
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=shared_seed(args.seed) if args.temperature > 0 else args.seed,  # every rank the same draws
        eos_token_id=eos,
        linears=route,
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
    if reused:
        report["prompt_cache"] = {k: v for k, v in reused.items() if k != "note"}
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


def _stdout_error(e: OSError) -> OSError:
    """A failed write of the text as an error naming stdout ("stdout: No space left on device")."""
    return OSError(e.errno, f"{e.strerror or e}; the text on stdout is incomplete", "stdout")
