"""Probes behind docs/quality.md's "Variance normalization" section, on the embedded model and a text.

usage:
  python scripts/varnorm_probe.py chunked TEXT N CHUNK SKIP SPEC[@k2+v2]...
      feed TEXT's first N tokens in chunks of CHUNK through each cache (each chunk attends to the earlier ones
      as stored), KL(reference || mode) per position from SKIP on. ``SPEC@k2`` runs SPEC with
      ``kvslim.formats.varnorm.AUTO`` = {("k", 2)} (with varnorm=auto: only K normalized), ``@v2`` only V.
  python scripts/varnorm_probe.py kernels TEXT PREFILL STEPS SPEC...
      prefill PREFILL tokens, then STEPS teacher-forced decode steps, once through the default kernels and once
      through the torch reference (set_backend("torch")): the largest logit difference at every STEPS/8-th step.
  python scripts/varnorm_probe.py mse TEXT N FORMAT...
      fill a cache with N tokens in one forward; each layer's stored K and V (decoded, model frame) against the
      uncompressed cache's: relative squared error, mean over layers, with varnorm off and on.
"""

from __future__ import annotations

import sys

import torch

import kvslim
import kvslim.formats.varnorm as varnorm
from kvslim import SlimCache, kernels, parse_spec
from kvslim.generate import decode_one_token, forward, prefill
from kvslim.models import load_model


def _cache(model, spec: str) -> SlimCache:
    return SlimCache.from_config(parse_spec(spec), config=model.config)


def chunked(model, ids, n: int, chunk: int, skip: int, specs: list[str]) -> None:
    ids = ids[:, :n]

    def run(spec: str) -> tuple[torch.Tensor, str]:
        cache = _cache(model, spec)
        out = [forward(model, ids[:, i : i + chunk], cache, logits_to_keep=0) for i in range(0, n, chunk)]
        return torch.cat(out, 1)[0].float().log_softmax(-1), cache.report()["varnorm"]

    ref, _ = run("none")
    auto = varnorm.AUTO
    for arg in specs:
        spec, _, streams = arg.partition("@")
        varnorm.AUTO = frozenset((a[0], int(a[1:])) for a in streams.split("+") if a) if streams else auto
        lp, which = run(spec)
        varnorm.AUTO = auto
        kl = (ref.exp() * (ref - lp)).sum(-1)[skip:]
        top1 = (lp.argmax(-1) == ref.argmax(-1))[skip:].float().mean()
        print(
            f"{arg:28s} varnorm={which:4s} KLD mean {kl.mean():.5f} p99 {kl.quantile(0.99):.4f} top-1 {top1:.4f}"
        )


def kernel_diff(model, ids, p: int, steps: int, specs: list[str]) -> None:
    for spec in specs:
        outs = {}
        for backend in ("auto", "torch"):
            kernels.set_backend(backend)
            cache = _cache(model, spec)
            prefill(model, ids[:, :p], cache)
            outs[backend] = torch.stack(
                [decode_one_token(model, ids[:, p + i : p + i + 1], cache) for i in range(steps)]
            )
        kernels.set_backend(None)
        d = (outs["auto"] - outs["torch"]).abs().amax(-1).flatten()
        print(
            spec, "max |kernels - torch| per step:", [f"{x:.2g}" for x in d.tolist()[:: max(1, steps // 8)]]
        )


def mse(model, ids, n: int, formats: list[str]) -> None:
    ids = ids[:, :n]

    def fill(spec: str) -> SlimCache:
        cache = _cache(model, spec)
        model(ids, past_key_values=cache)
        return cache

    ref = fill("none")
    for fmt in formats:
        res = {}
        for vn in ("off", "on"):
            cache = fill(f"{fmt},varnorm={vn}")
            res[vn] = [
                [
                    float((getattr(a, x) - getattr(b, x)).square().sum() / getattr(b, x).square().sum())
                    for a, b in zip(cache.layers, ref.layers, strict=True)
                ]
                for x in ("keys", "values")
            ]
        for j, role in enumerate("KV"):
            off, on = res["off"][j], res["on"][j]
            better = sum(a < b for a, b in zip(on, off, strict=True))
            print(
                f"{fmt} {role}: relative squared error off {sum(off) / len(off):.4g}, on {sum(on) / len(on):.4g}; "
                f"lower with varnorm in {better}/{len(off)} layers"
            )


def main(argv: list[str]) -> int:
    mode, text, a, b, *rest = argv
    torch.set_grad_enabled(False)
    model, tok = load_model(None)
    kvslim.enable(model)  # decode steps attend on the codes, as users run it
    with open(text, encoding="utf-8") as f:
        ids = tok(f.read(), return_tensors="pt").input_ids
    if mode == "chunked":
        chunked(model, ids, int(a), int(b), int(rest[0]), rest[1:])
    elif mode == "kernels":
        kernel_diff(model, ids, int(a), int(b), rest)
    elif mode == "mse":
        mse(model, ids, int(a), [b, *rest])
    else:
        raise SystemExit(f"mode must be chunked, kernels or mse, got {mode!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
