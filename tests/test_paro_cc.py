"""PaRO-CC (paro_fsdp/paro_cc.py) equals the flat collective over the flattened mesh, on real
gloo ranks: 4 ranks as 2 groups x 2, and 8 ranks as 2 x 4 (the case where m > g, so a wrong
rank order or block transpose cannot hide). Uneven sizes, forced chunk counts, fp32 and bf16;
and every case again below ``flat_below_bytes``, where PaRO-CC runs the flat collective itself.

Why integer-valued data: a hierarchical sum adds in a different order than the flat ring, so
random floats may differ in the last bit; small integers sum exactly in fp32 and bf16, which
lets the sum / max / min cases demand bit equality. One random-float case per kind checks
tolerance-level agreement too.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from dist_harness import run_world

AG_SHAPES = [(1,), (5,), (7, 3), (1000,), (33, 2, 3)]
RS_BLOCK_SHAPES = [(1,), (5,), (7, 3), (1000,)]  # per-rank block; the input is n times dim 0
AR_SHAPES = [(1,), (3,), (5,), (17,), (7, 3), (1001,), (64, 4)]
CHUNKS = [None, 1, 3, 4]
DTYPES = ["float32", "bfloat16"]


def _cases() -> list[tuple]:
    cases: list[tuple] = []
    for dt in DTYPES:
        for shape in AG_SHAPES:
            for ch in CHUNKS:
                for order in ("flat", "nested"):
                    cases.append(("all_gather", dt, shape, ch, order, "sum", "int"))
        for shape in RS_BLOCK_SHAPES:
            for ch in CHUNKS:
                for order in ("flat", "nested"):
                    cases.append(("reduce_scatter", dt, shape, ch, order, "sum", "int"))
            for op in ("avg", "max"):
                cases.append(("reduce_scatter", dt, shape, 3, "flat", op, "int"))
        for shape in AR_SHAPES:
            for ch in CHUNKS:
                cases.append(("all_reduce", dt, shape, ch, "flat", "sum", "int"))
            for op in ("avg", "max", "min"):
                cases.append(("all_reduce", dt, shape, 3, "flat", op, "int"))
        for kind, shape in (("all_gather", (257,)), ("reduce_scatter", (257,)), ("all_reduce", (1001,))):
            cases.append((kind, dt, shape, 4, "flat", "sum", "rand"))
    return cases


CASES = _cases()


def _case_id(case: tuple) -> str:
    kind, dt, shape, ch, order, op, data = case
    return f"{kind}-{dt}-{'x'.join(map(str, shape))}-c{ch}-{order}-{op}-{data}"


def suite(payload: dict) -> dict:
    """Runs on every rank: each case through PaRO-CC and through the flat collective."""
    import torch.distributed as dist

    from paro_fsdp.comm import MeshComm
    from paro_fsdp.mesh import MeshInfo, init_paro_mesh
    from paro_fsdp.paro_cc import ParoCC, flat_to_nested, nested_to_flat

    ops = torch.ops._c10d_functional
    m = payload["m"]
    info = MeshInfo.from_mesh(init_paro_mesh(m))
    n, rank = info.n, dist.get_rank()
    assert rank == info.k * info.m + info.l  # the flat order the module promises
    cc = ParoCC(MeshComm(info.groups), chunk_bytes=256, max_chunks=5)  # small chunks: default chunking kicks in
    flat = ParoCC(MeshComm(info.groups), chunk_bytes=256, flat_below_bytes=1 << 30)  # every case runs flat
    stats = cc.comm.stats
    gname = info.group_names["global"]
    out: dict = {}
    for case in payload["cases"]:
        kind, dt, shape, ch, order, op, data = case
        dtype = getattr(torch, dt)
        gen = torch.Generator().manual_seed(1000 * rank + len(out))
        if kind == "reduce_scatter":
            shape = (n * shape[0], *shape[1:])
        if data == "int":
            x = torch.randint(-8, 9, shape, generator=gen).to(dtype)
        else:
            x = torch.randn(shape, generator=gen).to(dtype)
        def call(c: ParoCC) -> torch.Tensor:
            if kind == "all_gather":
                return c.all_gather(x, order=order, chunks=ch).wait()
            if kind == "reduce_scatter":  # the nested input holds rank (k, l)'s block at l * g + k
                return c.reduce_scatter(flat_to_nested(x, info.g, m) if order == "nested" else x, op=op, order=order,
                                        chunks=ch).wait()
            return c.all_reduce(x, op=op, chunks=ch).wait()

        try:
            if kind == "all_gather":
                want = ops.wait_tensor(ops.all_gather_into_tensor(x, n, gname))
                if order == "nested":
                    assert torch.equal(nested_to_flat(flat_to_nested(want, info.g, m), info.g, m), want)
                    want = flat_to_nested(want, info.g, m)
            elif kind == "reduce_scatter":
                want = ops.wait_tensor(ops.reduce_scatter_tensor(x, op, n, gname))
            else:
                want = ops.wait_tensor(ops.all_reduce(x.clone(), op, gname))
            got = call(cc)
            flat.comm.stats.reset()
            got_flat = call(flat)  # below flat_below_bytes: the flat collective itself, bit for bit
            flat_ok = torch.equal(got_flat, want) and got_flat.shape == want.shape and \
                set(flat.comm.stats.as_dict()) == {f"{kind}/global"} and flat.comm.stats.count() == 1
            parts_ok = None
            if kind == "all_gather" and order == "nested" and x.dim() == 1:  # the chunks, not assembled
                parts_ok = all(_assembled(c.all_gather(x, order="nested", chunks=ch, parts=True).wait(), x.numel())
                               .equal(want.view(m, info.g, -1)) for c in (cc, flat))
        except Exception as e:  # noqa: BLE001 - report per case
            out[case] = {"error": f"{type(e).__name__}: {e}"}
            continue
        exact = data == "int" and op != "avg"
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        out[case] = {
            "shape_ok": tuple(got.shape) == tuple(want.shape),
            "dtype_ok": got.dtype == want.dtype,
            "equal": torch.equal(got, want),
            "max_err": err,
            "scale": want.float().abs().max().item() if want.numel() else 0.0,
            "exact": exact,
            "flat_ok": flat_ok,
            "parts_ok": parts_ok,
        }
    # one-level meshes (1 x n: all intra; n x 1: all inter) reduce to the plain collective
    for m_alt in (n, 1):
        alt = ParoCC(MeshComm(MeshInfo.from_mesh(init_paro_mesh(m_alt)).groups), chunk_bytes=256)
        x = torch.arange(6.0) + rank
        ok = torch.equal(alt.all_gather(x).wait(), ops.wait_tensor(ops.all_gather_into_tensor(x, n, gname)))
        y = torch.arange(6.0 * n) * (rank + 1)
        ok &= torch.equal(alt.reduce_scatter(y).wait(), ops.wait_tensor(ops.reduce_scatter_tensor(y, "sum", n, gname)))
        ok &= torch.equal(alt.all_reduce(y[:7]).wait(), ops.wait_tensor(ops.all_reduce(y[:7].clone(), "sum", gname)))
        nested = flat_to_nested(ops.wait_tensor(ops.all_gather_into_tensor(x, n, gname)), n // m_alt, m_alt)
        ok &= _assembled(alt.all_gather(x, order="nested", parts=True).wait(), 6).equal(
            nested.view(m_alt, n // m_alt, 6)
        )
        out[f"one_level_{m_alt}"] = ok
    # ledger: a 4-chunk all-gather of a (1000,) fp32 shard records 4 inter + 4 intra all-gathers
    stats.reset()
    cc.all_gather(torch.ones(1000), chunks=4).wait()
    out["stats"] = {
        "count_inter": stats.count("all_gather", "inter"),
        "count_intra": stats.count("all_gather", "intra"),
        "bytes_inter": stats.bytes(dim="inter"),
        "bytes_intra": stats.bytes(dim="intra"),
    }
    # all-reduce: chunks are whole rows of m, so a size m divides is counted exactly
    stats.reset()
    cc.all_reduce(torch.ones(m * 300), chunks=3).wait()
    out["stats_ar"] = {dim: stats.bytes(dim=dim) for dim in ("intra", "inter")}
    # the first phase of every chunk is issued by the call itself (overlap needs it): the
    # functional ops' outputs exist before wait() is called
    pend = cc.reduce_scatter(torch.ones(n * 64), chunks=4)
    out["async_ok"] = pend._finish is not None
    out["async_val"] = torch.equal(pend.wait(), torch.full((64,), float(n)))
    out["side_streams"] = _side_stream_checks(info, cc, n)
    return out


def _assembled(parts: list, s: int) -> torch.Tensor:
    """An all-gather's ``parts=True`` result as one [m, g, s] tensor, after checking that its
    chunks cover columns 0..s in order."""
    assert [a for a, _, _ in parts] == [0] + [b for _, b, _ in parts[:-1]] and parts[-1][1] == s, [p[:2] for p in parts]
    assert all(p.shape[2] == b - a for a, b, p in parts)
    return torch.cat([p for _, _, p in parts], dim=2)


class RecordingStreams:
    """CommStreams' interface on CPU (paro_fsdp/streams.py): which side stream each call issued
    on, and how often a consumer waited for its event."""

    def __init__(self) -> None:
        self.issued: list[str] = []
        self.waited = 0

    @contextlib.contextmanager
    def issue(self, kind: str):
        self.issued.append(kind)
        yield self

    def record_event(self) -> object:
        return object()

    def wait(self, event: object) -> None:
        self.waited += 1


def _side_stream_checks(info, plain, n: int) -> dict:
    """With side streams (a GPU), every phase of a PaRO-CC collective is issued by the call
    itself (none from wait()), on the stream of its kind, and results equal the CPU path's."""
    from paro_fsdp.comm import MeshComm
    from paro_fsdp.collectives import HIER, Kind
    from paro_fsdp.paro_cc import ParoCC

    rec = RecordingStreams()
    cc = ParoCC(MeshComm(info.groups, streams=rec), chunk_bytes=256, max_chunks=5)
    stats = cc.comm.stats
    x = torch.arange(1000.0) + info.k * info.m + info.l
    out = {}
    for kind, call, phases in (
        (
            "all_gather",
            lambda c: c.all_gather(x, order="nested", chunks=4),
            dict.fromkeys(HIER[Kind.ALL_GATHER], 4),
        ),
        (
            "reduce_scatter",
            lambda c: c.reduce_scatter(torch.cat([x] * n), order="nested", chunks=4),
            dict.fromkeys(HIER[Kind.REDUCE_SCATTER], 4),
        ),
        (
            "all_reduce",
            lambda c: c.all_reduce(x, chunks=3),
            dict.fromkeys(HIER[Kind.ALL_REDUCE], 3),
        ),
    ):
        stats.reset()
        waited = rec.waited
        pend = call(cc)
        issued_at_call = all(stats.count(k, d) == c for (k, d), c in phases.items())
        got = pend.wait()
        out[kind] = {"issued_at_call": issued_at_call, "waited": rec.waited - waited,
                     "equal": torch.equal(got, call(plain).wait())}
    comm = MeshComm(info.groups, streams=rec)
    before = len(rec.issued)
    a = comm.all_gather(x, "intra").wait()
    r = comm.reduce_scatter(torch.cat([x] * info.m), "intra").wait()
    ops = torch.ops._c10d_functional
    out["mesh_comm"] = {
        "kinds": rec.issued[before:],
        "equal": torch.equal(a, ops.wait_tensor(ops.all_gather_into_tensor(x, info.m, info.group_names["intra"])))
        and torch.equal(r, ops.wait_tensor(ops.reduce_scatter_tensor(torch.cat([x] * info.m), "sum", info.m,
                                                                    info.group_names["intra"]))),
    }
    out["issued"] = rec.issued
    return out


def _check(results: list[dict], case: tuple) -> None:
    for rank, res in enumerate(results):
        r = res[case]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["shape_ok"] and r["dtype_ok"], (rank, r)
        assert r["flat_ok"], (rank, r)  # the flat branch is the flat collective, counted once as global
        assert r["parts_ok"] in (None, True), (rank, r)  # chunks as they arrived: the same columns
        if r["exact"]:
            assert r["equal"], (rank, r)
        else:
            tol = (2e-2 if case[1] == "bfloat16" else 1e-5) * max(1.0, r["scale"])
            assert r["max_err"] <= tol, (rank, r)


@pytest.fixture(scope="module")
def results4() -> list[dict]:
    return run_world(4, "test_paro_cc:suite", {"m": 2, "cases": CASES})


@pytest.fixture(scope="module")
def results8() -> list[dict]:
    return run_world(8, "test_paro_cc:suite", {"m": 4, "cases": CASES})


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_equals_flat_2x2(results4, case):
    _check(results4, case)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_equals_flat_2x4(results8, case):
    _check(results8, case)


@pytest.mark.parametrize("shape", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_stats_and_async(request, shape):
    results, (g, m) = request.getfixturevalue("results4" if shape == (2, 2) else "results8"), shape
    n = g * m
    for r in results:
        s = r["stats"]
        assert s["count_inter"] == 4 and s["count_intra"] == 4, s
        # inter AG of the shard: (g-1) * 1000 * 4 bytes; intra AG of g * 1000: (m-1) * g * 1000 * 4
        assert s["bytes_inter"] == pytest.approx((g - 1) * 4000)
        assert s["bytes_intra"] == pytest.approx((m - 1) * g * 4000)
        assert r["async_ok"] and r["async_val"]
        assert r["one_level_1"] and r[f"one_level_{n}"]
        # intra RS(S) + intra AG(S) = 2 (m-1)/m S; inter AR(S/m) = 2 (g-1)/g S/m; S = m * 300 * 4 bytes
        size = m * 300 * 4
        assert r["stats_ar"]["intra"] == pytest.approx(2 * (m - 1) / m * size)
        assert r["stats_ar"]["inter"] == pytest.approx(2 * (g - 1) / g * size / m)
        assert n == len(results)


@pytest.mark.parametrize("shape", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_side_streams_issue_every_phase_at_call(request, shape):
    """The GPU path (streams.py): a PaRO-CC collective issues all its phases when called, on the
    gather or reduce side stream, and the consumer waits once on its event; same results."""
    results = request.getfixturevalue("results4" if shape == (2, 2) else "results8")
    for r in results:
        s = r["side_streams"]
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert s[kind] == {"issued_at_call": True, "waited": 1, "equal": True}, (kind, s[kind])
        assert s["issued"][:3] == ["gather", "reduce", "reduce"]
        assert s["mesh_comm"] == {"kinds": ["gather", "reduce"], "equal": True}


def test_nested_all_gather_parts_were_checked(results4):
    checked = [c for c in CASES if results4[0][c].get("parts_ok") is True]
    assert len(checked) == sum(c[0] == "all_gather" and c[4] == "nested" and len(c[2]) == 1 for c in CASES) > 0
