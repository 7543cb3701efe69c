"""One engine step's forward: what it carries, and what each row takes from it.

A step is ONE model forward (chunked prefill mixed into the decode step, as Sarathi-Serve and vLLM schedule
it): every decoding row's pending token, plus the next prompt chunk of each row :meth:`Scheduler.prefill_plan
<kvslim.engine.scheduler.Scheduler.prefill_plan>` picked, within the step's budget of ``prefill_chunk`` prompt
tokens (decode tokens are not counted against it), packed into one sequence
(:func:`kvslim.generate.forward_step`: the linear layers once over all the step's tokens with no padding, each
row's attention on its own cache). A joining prompt no longer pauses the decoding rows: its chunk rides in
their forward. A row's chunks are the ones it would have alone (``min(prefill_chunk, tokens left)`` each: the
budget never cuts a chunk), and every row's logits are bit for bit those of the row in a step of its own
(:mod:`kvslim.cache.ragged`, "Packed, not padded" and "Filler rows"), so greedy output equals the request run
alone. A step with no prompt chunk is :func:`kvslim.generate.forward_rows`.

With pages and ``compile=True`` a step is two forwards when it carries both a prompt chunk and decoding rows: the
chunks eagerly (their rows done with: fed, first token sampled), then the decoding rows through the compiled paged
step (:mod:`kvslim.cache.paged_compiled`), whose fused loops round differently from the eager ops. A decode token is
then always the compiled step's and a prompt chunk always the eager step's, whatever shares the step, so greedy
output still equals the request run alone through the same engine (not through one without ``compile``: the
logits differ by ~1e-5). The second forward reads the weights once more, on the steps a prompt joins only, and a
failure in either forward ends only its own rows.

:class:`Stepping` is the step half of :class:`~kvslim.engine.engine.Engine` (the forward and each row's share
of it); :func:`finite` and :func:`sample` turn a row's logits into its token. Nothing here admits, ends or
keeps a row: the engine does (``_fail``, ``_emit``).
"""

from __future__ import annotations

import torch

from .. import generate as gen
from ..cache.paged_adapter import forward_pages
from .scheduler import Row


def forward(
    model,
    prefilled: list[Row],
    rows: list[Row],
    chunk: int,
    errors: dict,
    row_multiple: int = gen.ROW_MULTIPLE,
    pool=None,
    compiled=None,
) -> tuple[list[int], torch.Tensor]:
    """The step's one forward: the next chunk (at most ``chunk`` tokens) of each row in ``prefilled``, then the
    pending token of each row in ``rows``. Returns (where each prompt row's chunk ends, logits (P + R, V) of each
    row's last new token). errors: receives ``{index: exception}`` for a row dropped from the forward.
    row_multiple: filler rows pad the step to a multiple of it (:meth:`Linears.row_multiple
    <kvslim.engine.linears.Linears.row_multiple>`: 1 where every product rounds a row alike at any row count).
    pool: the engine's :class:`~kvslim.cache.pagepool.PagePool` when its rows live in pages
    (:func:`kvslim.cache.paged_adapter.forward_pages`: a failure fails the whole forward, no row is dropped).
    compiled: the engine's :class:`~kvslim.cache.paged_compiled.CompiledStep` (with ``pool``), which runs a forward
    of decoding rows only; a forward with a prompt chunk runs eagerly (:meth:`Stepping._forward` splits a step that
    has both, module docstring)."""
    ends = [min(r.fed + chunk, len(r.request.prompt)) for r in prefilled]
    if pool is not None:
        feeds = [(r.request.prompt[r.fed : end], r.cache.row) for r, end in zip(prefilled, ends, strict=True)]
        feeds += [([r.pending], r.cache.row) for r in rows]
        compiled = None if prefilled else compiled  # (a prompt's chunks always eagerly, even of one token)
        return ends, forward_pages(model, pool, feeds, row_multiple=row_multiple, compiled=compiled)
    if not prefilled:
        return ends, gen.forward_rows(
            model, [r.pending for r in rows], [r.cache for r in rows], row_multiple=row_multiple, errors=errors
        )
    feeds = [(r.request.prompt[r.fed : end], r.cache) for r, end in zip(prefilled, ends, strict=True)]
    feeds += [([r.pending], r.cache) for r in rows]
    return ends, gen.forward_step(model, feeds, row_multiple=row_multiple, errors=errors)


def finite(logits: torch.Tensor) -> torch.Tensor:
    """(B,) bool: whether each row's logits can be sampled (no NaN, no +inf, some finite value; a -inf logit is a
    token the model rules out)."""
    bad = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1)
    return ~bad & torch.isfinite(logits).any(dim=-1)


def generator(request, device) -> torch.Generator | None:
    """A request's sampling generator (:func:`kvslim.generate.sampling_generator`)."""
    return gen.sampling_generator(request.temperature, request.seed, device)


def sample(row: Row, logits: torch.Tensor, is_finite: bool | None = None):
    """Row ``row``'s next token from ``logits`` (1, V), with its logprob and top alternatives when asked:
    ``(token, logprob | None, top_logprobs | None)``. Non-finite logits raise (that row ends)."""
    if is_finite is None:
        is_finite = bool(finite(logits)[0])
    if not is_finite:
        raise ValueError("the model's logits for this request are not finite (NaN or inf)")
    req = row.request
    token = int(gen.sample_next(logits, req.temperature, req.top_p, row.generator)[0])
    if req.logprobs is None:
        return token, None, None
    lp = torch.log_softmax(logits[0].float(), dim=-1)  # (V,), the raw logits: before temperature and top_p
    top: tuple = ()
    if req.logprobs:
        values, ids = lp.topk(min(req.logprobs, lp.numel()))  # sorted, most likely first
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return token, float(lp[token]), top


class Stepping:
    """The step half of :class:`~kvslim.engine.engine.Engine`: its one forward and each row's share of it. Reads
    the engine's ``model``, ``linears``, ``scheduler``, ``prefill_chunk``, ``pool``, ``compiled``, ``results``,
    ``prefilled_tokens``; ends rows through its
    ``_fail`` and hands tokens to its ``_emit``."""

    def _forward(self, prefilled: list[Row], rows: list[Row], events: list) -> None:
        """ONE forward for the step (module docstring), or with ``compiled`` two when the step has both prompt chunks
        and decoding rows: the chunks eagerly, each prompt row done with before the decoding rows' compiled forward,
        so a failure (or an interrupt) in either leaves the other's rows as a forward of their own would."""
        if self.compiled is not None and prefilled and rows:
            self._forward_rows(prefilled, [], events)
            self._forward_rows([], rows, events)
        else:
            self._forward_rows(prefilled, rows, events)

    def _forward_rows(self, prefilled: list[Row], rows: list[Row], events: list) -> None:
        """One forward of ``prefilled``'s chunks and ``rows``' tokens, and each row's share of it. A row whose part of
        it fails (its K/V refused, its attention raising) is dropped from it and ends alone; a forward that fails as a
        whole ends every row of it."""
        everyone = prefilled + rows
        phases = ["prefill"] * len(prefilled) + ["the decode step"] * len(rows)
        errors: dict = {}
        for r in prefilled:
            self.scheduler.start_prefill(r, self.prefill_chunk)
        try:
            with self.linears.routed() as route:  # the model's linear layers through the engine's route
                ends, logits = forward(
                    self.model, prefilled, rows, self.prefill_chunk, errors, route.row_multiple(), self.pool,
                    self.compiled,
                )
            ok = finite(logits).tolist()  # one sync for the step
        except Exception as e:  # noqa: BLE001 - the forward failed as a whole: its rows end, the engine goes on
            for b, r in enumerate(everyone):
                self._fail(r, events, phases[b], errors.get(b, e))
            return
        for b, r in enumerate(everyone):
            if b in errors:  # dropped from the step: the other rows' logits are exact
                self._fail(r, events, phases[b], errors[b])
                continue
            phase = phases[b]
            try:
                if b < len(ends):  # a prompt chunk: its first token comes with its last chunk
                    self.prefilled_tokens += ends[b] - r.fed
                    r.fed = ends[b]
                    self._track(r)
                    if r.fed < len(r.request.prompt):
                        continue
                    self.scheduler.end_prefill(r)
                    r.state = "decode"
                else:
                    self._track(r)
                phase = "sampling"
                token, logprob, top = sample(r, logits[b : b + 1], ok[b])
            except Exception as e:  # noqa: BLE001 - this row alone
                self._fail(r, events, phase, e)
                continue
            self._emit(r, token, logprob, top, events)

    def _track(self, row: Row) -> None:
        n = row.cache.nbytes()
        row.peak_bytes = max(row.peak_bytes, n)
        self.results[row.request_id].cache_bytes = row.peak_bytes
