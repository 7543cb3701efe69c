"""The rows call's piece records kept with the body they were built from (kernels.cpu._row_pieces): a body handed
out again unchanged (the same view tensors, as a cache hands them out between flushes) reuses its record without
re-checking it, with the same bits; a body with any other part, another codec or offset, or a part the call would
have to copy, is checked and recorded again; a piece with its own queries is never kept."""

from __future__ import annotations

import copy

import torch

from kvslim.formats import Encoded
from kvslim.kernels import bench, cpu

H, M, D = 3, 3, 64


def _rows(name: str = "int4", n_rows: int = 3, length: int = 300, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = bench._row_layers(name, n_rows, [length] * n_rows, 16, H, D, 1, 32, gen)[0]
    q = torch.randn(n_rows, H, M, D, generator=gen) * D**-0.5
    return rows, q


def _counting(monkeypatch) -> list:
    calls = []
    real = cpu.body_layout

    def spy(*args, **kwargs):
        calls.append(args[0].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, "body_layout", spy)
    return calls


def _call(q, rows) -> torch.Tensor:
    out = torch.zeros_like(q)
    assert cpu.attend_rows(q, rows, out) == []
    return out


def _mapped(rows, fn):
    """The rows with every body part replaced by fn(part)."""

    def body(pieces):
        return tuple(
            (c, Encoded({n: fn(t) for n, t in e.token.items()}, {n: fn(t) for n, t in e.group.items()}), o)
            for c, e, o in pieces
        )

    return [r._replace(k_body=body(r.k_body), v_body=body(r.v_body)) for r in rows]


def _fresh(rows):
    """The same bodies as new view tensors (as a cache hands them out after a change): nothing kept applies."""
    return _mapped(rows, lambda t: t[:, :, :])


def test_an_unchanged_body_reuses_its_record_with_the_same_bits(monkeypatch):
    rows, q = _rows()
    calls = _counting(monkeypatch)
    first = _call(q, rows)
    assert len(calls) == 2 * len(rows)  # each row's K and V body checked once
    again = _call(q, rows)
    assert len(calls) == 2 * len(rows)  # nothing checked again
    assert torch.equal(first, again)
    rebuilt = _call(q, _fresh(rows))
    assert len(calls) == 4 * len(rows)
    assert torch.equal(first, rebuilt)


def test_another_part_codec_or_offset_is_recorded_again(monkeypatch):
    rows, q = _rows()
    before = _call(q, rows)
    calls = _counting(monkeypatch)
    codec, enc, off = rows[0].v_body[0]
    scale = enc.token["scale"] * 2  # a new V scale part beside the same codes: another body
    changed = Encoded({**enc.token, "scale": scale}, dict(enc.group))
    rows2 = [rows[0]._replace(v_body=((codec, changed, off),)), *rows[1:]]
    out = _call(q, rows2)
    assert calls == [codec.name]  # only the changed body is checked again
    assert not torch.equal(out[0], before[0]) and torch.equal(out[1:], before[1:])
    alone = torch.zeros_like(q)
    assert cpu.attend_rows(q, [_fresh(rows2)[0]], alone) == []
    assert torch.equal(out[0], alone[0])  # the new record, not the old one
    kc, kenc, koff = rows[1].k_body[0]
    rows3 = [rows[0], rows[1]._replace(k_body=((kc, kenc, koff + 1),)), rows[2]]
    _call(q, rows3)
    assert calls[-1] == kc.name  # another offset: checked again


def test_a_part_the_call_copies_is_never_kept(monkeypatch):
    rows, q = _rows()
    codec, enc, off = rows[0].k_body[0]
    codes = enc.token["codes"]
    wide = torch.zeros(*codes.shape[:3], 2 * codes.shape[3], dtype=codes.dtype)
    wide[..., ::2] = codes
    strided = Encoded({**enc.token, "codes": wide[..., ::2]}, dict(enc.group))  # dim 3 not contiguous: copied
    rows2 = [rows[0]._replace(k_body=((codec, strided, off),)), *rows[1:]]
    expected = _call(q, rows)
    calls = _counting(monkeypatch)
    for _ in range(2):
        assert torch.equal(_call(q, rows2), expected)
    assert calls.count(codec.name) >= 2 and calls[: len(calls) // 2] == calls[len(calls) // 2 :]


def test_a_piece_with_its_own_queries_is_never_kept(monkeypatch):
    rows, q = _rows()
    codec, enc, off = rows[0].k_body[0]
    own = (q[0:1] * 0.5).contiguous()
    rows2 = [rows[0]._replace(k_body=((codec, enc, off, own),)), *rows[1:]]
    calls = _counting(monkeypatch)
    a = _call(q, rows2)
    n = len(calls)
    b = _call(q, rows2)
    assert torch.equal(a, b) and len(calls) - n == 1  # the own-queries K piece only, again


def test_a_deep_copy_of_a_body_gets_its_own_record():
    """A deep copy carries the kept record (a tensor's attributes are copied) to new memory: the copy must not be
    read through the original's pointers."""
    rows, q = _rows()
    _call(q, rows)  # records kept on the originals
    twin = copy.deepcopy(rows)
    for r in rows:  # the originals change after the copy: the twin's answer must not
        for _, enc, _ in (*r.k_body, *r.v_body):
            for t in (*enc.token.values(), *enc.group.values()):
                t.zero_()
    expected = _call(q, _mapped(twin, torch.clone))
    assert torch.equal(_call(q, twin), expected)


def test_a_part_at_the_same_address_read_otherwise_is_recorded_again():
    """A kept record holds a part's strides as well as its pointer: another tensor over the same memory (the same
    data pointer) read with other strides is another part, and the record is built again for it (the record is
    found by the parts' identity, not their pointers alone)."""
    rows, q = _rows()
    before = _call(q, rows)
    codec, enc, off = rows[0].v_body[0]
    scale = enc.token["scale"]
    s = scale.stride()
    alias = scale.as_strided(scale.shape, (s[0], s[1], 0, s[3]))  # the same address, every token its first scale
    assert alias.data_ptr() == scale.data_ptr() and not torch.equal(alias, scale)
    rows2 = [rows[0]._replace(v_body=((codec, Encoded({**enc.token, "scale": alias}, dict(enc.group)), off),)), *rows[1:]]
    out = _call(q, rows2)
    alone = torch.zeros_like(q)
    assert cpu.attend_rows(q, [_fresh(rows2)[0]], alone) == []
    assert torch.equal(out[0], alone[0]) and not torch.equal(out[0], before[0])
