"""The rows call's piece records found again instead of built (kernels.records, read by kernels.cpu._row_pieces): a
body handed out again unchanged (the same view tensors, as a cache hands them out between flushes) reuses the record
kept on it; a body of new views with a signature seen before (the same codec, offset, shapes, strides and dtypes:
every layer of a row, every row at the same phase) takes the template's record with its own pointers written in;
both give the bits a record built and checked anew gives. A body with any other part, codec or offset, or a part
the call would have to copy, is checked and recorded again; a piece with its own queries is never kept on the body,
and takes a template with its own queries' pointer."""

from __future__ import annotations

import copy

import torch

from kvslim.formats import Encoded
from kvslim.kernels import bench, cpu, records

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


def _alone(q, row) -> torch.Tensor:
    """Row ``row``'s output computed alone from a record built and checked anew (no template kept)."""
    records.clear_templates()
    out = torch.zeros_like(q)
    assert cpu.attend_rows(q, [_fresh([row])[0]], out) == []
    records.clear_templates()
    return out[row.qrow]


def test_an_unchanged_body_reuses_its_record_with_the_same_bits(monkeypatch):
    records.clear_templates()
    rows, q = _rows(length=300)
    calls = _counting(monkeypatch)
    first = _call(q, rows)
    assert len(calls) == 2  # row 0's K and V bodies checked; rows 1 and 2 (the same geometry) from the templates
    again = _call(q, rows)
    assert len(calls) == 2  # nothing checked again
    assert torch.equal(first, again)
    rebuilt = _call(q, _fresh(rows))  # new views, the same signatures: templates, no checks
    assert len(calls) == 2
    assert torch.equal(first, rebuilt)
    records.clear_templates()
    assert torch.equal(_call(q, _fresh(rows)), first)
    assert len(calls) == 4  # no template: checked again, once per signature
    for r in rows:
        assert torch.equal(first[r.qrow], _alone(q, r))


def test_a_moved_body_takes_a_template_with_its_own_pointers(monkeypatch):
    """Bodies whose front moved (a windowed cache drops a token a step: K a token further into its group, V's views
    one token on) take their records from the template of the first row moved alike: each reads its own memory."""
    records.clear_templates()
    rows, q = _rows(length=300)
    _call(q, rows)

    def moved(pieces, by):
        return tuple((c, *e.narrow(by, e.token[next(iter(e.token))].shape[2], o, c.token_group)) for c, e, o in pieces)

    for by in (1, 5, 31, 33):
        rows2 = [r._replace(k_body=moved(r.k_body, by), v_body=moved(r.v_body, by)) for r in rows]
        calls = _counting(monkeypatch)
        out = _call(q, rows2)
        assert len(calls) == 2, by  # row 0 checked, rows 1 and 2 from its templates
        for r in rows2:
            assert torch.equal(out[r.qrow], _alone(q, r)), (by, r.qrow)
        assert not torch.equal(out[1], out[2])
        monkeypatch.undo()


def test_templates_are_bounded(monkeypatch):
    records.clear_templates()
    monkeypatch.setattr(records, "TEMPLATES_KEPT", 3)
    rows, q = _rows(n_rows=1, length=300)
    r = rows[0]
    for length in (100, 132, 164, 196, 228):
        k, v = (tuple((c, *e.narrow(0, length, o, c.token_group)) for c, e, o in p) for p in (r.k_body, r.v_body))
        _call(q[:1], [r._replace(k_body=k, v_body=v, k_res=None, v_res=None)])
        assert len(records._TEMPLATES) <= 3
    records.clear_templates()


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
    """Never kept on its body (the queries change every step); its template takes each piece's own queries."""
    records.clear_templates()
    rows, q = _rows()
    codec, enc, off = rows[0].k_body[0]
    own = (q[0:1] * 0.5).contiguous()
    rows2 = [rows[0]._replace(k_body=((codec, enc, off, own),)), *rows[1:]]
    calls = _counting(monkeypatch)
    a = _call(q, rows2)
    assert not hasattr(enc.token["codes"], records._MEMO)
    n = len(calls)
    other = (q[0:1] * -2.0).contiguous()  # the same layout: the template, with these queries' pointer
    b = _call(q, [rows[0]._replace(k_body=((codec, enc, off, other),)), *rows[1:]])
    assert len(calls) == n  # nothing checked: the template
    assert not torch.equal(a[0], b[0]) and torch.equal(a[1:], b[1:])
    for qk, got in ((own, a), (other, b)):
        records.clear_templates()
        alone = torch.zeros_like(q)
        assert cpu.attend_rows(q, [rows[0]._replace(k_body=((codec, enc, off, qk.clone()),))], alone) == []
        assert torch.equal(got[0], alone[0])


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
