"""Part (d): four real ranks on one device (a 2 x 2 mesh over gloo), every collective through the
stand-in kernels of ``standin.py``, so that a missing wait, a side stream that does not wait for
the compute stream, or a consumer that reads too early changes the numbers; each strategy must
match one process to float tolerance.

Two worlds, each reporting a case as soon as every rank finished it (``world.run_world``):
1. the core strategies (one per level and the mixed ones: NNN, III, IIG, GGG, NIG, ING), then the
   self-test: the same workload with a bug planted (``plants.py``), which must FAIL;
2. one compiled block (GGG's ``layers.0`` with the graph passes: its graphs hold the block's
   collectives) and the other 21 strategies.
On CUDA every rank runs on the one GPU, the stand-in delays each result behind a sleep and the
model stalls the compute stream (``workload.delay``); on CPU the deferred completion alone
decides (a consumer that skips ``wait()`` reads NaN).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .checks import FAIL, PASS, SKIP, STREAMS_TOL, check
from .report import Emitter

CORE = ("NNN", "III", "IIG", "GGG", "NIG", "ING")
PLANTED = ("NNN", "IIG", "GGG")  # one strategy per level, each planted run must fail
COMPILED = "GGG"
#: on CUDA: the compute stream's stall (each delay op, before clipping and before the step) and
#: how long every collective's result waits behind a sleep. The result delay must exceed the
#: compute stream's lag between a collective's wait and its consumer (at most a stall and a tiny
#: block): 4x. Both are short because four processes time-slice one GPU: ~140 results per GGG run
DELAY_MS, RESULT_MS = 0.5, 2.0
MARGIN_S = 10.0  # left of the part's timeout to report what did not finish


def d_strategies(spec: str | None) -> list[str]:
    """Part (d)'s strategies: all 27 (None), or a comma-separated list. Raises ValueError (one line)."""
    names = ["".join(s) for s in itertools.product("NIG", repeat=3)]  # paro_fsdp.ALL_STRATEGIES, without the engine
    if not spec:
        return names
    got = [x.strip().upper() for x in spec.split(",") if x.strip()]
    bad = [x for x in got if x not in names]
    if bad or not got:
        raise ValueError(f"--d-strategies {spec!r} is invalid; valid: a comma-separated list of strategies like IIG,GGG")
    return got


# ---- inside a rank ----------------------------------------------------------------------------------
def rank_device(kind: str) -> Any:
    """The device this rank runs on: GPU 0 for every rank (one GPU), or the CPU."""
    import torch

    if kind == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.init()
        return torch.device("cuda", 0)
    return torch.device("cpu")


def rank_main(payload: dict[str, Any], send: Callable[[Any], None]) -> dict[str, Any]:
    """Every case of ``payload["cases"]`` on this rank, each sent as soon as it is done: its result
    (``workload.train_sharded``), what the stand-in served, the seconds it took."""
    from torch.distributed.device_mesh import init_device_mesh

    from .plants import planted
    from .standin import StandIn
    from .workload import cycles_per_ms, train_sharded

    device = rank_device(payload["device"])
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("inter", "intra"))
    cpm = cycles_per_ms(device) if device.type == "cuda" else 0.0
    delay, result = int(payload.get("delay_ms", 0) * cpm), int(payload.get("result_ms", 0) * cpm)
    standin = StandIn(device.type, result).install()
    for case in payload["cases"]:
        t0 = time.monotonic()
        before = standin.stats.snapshot()
        with planted(case.get("plant") or payload.get("plant"), device.type):
            out = train_sharded(mesh, case["strategy"], device, delay_cycles=delay, stall_cycles=delay,
                                compiled=case.get("compiled", False))
        send({"case": case["id"], "seconds": time.monotonic() - t0, "standin": standin.stats.since(before), **out})
    return {"cycles_per_ms": cpm}


# ---- the parent ----------------------------------------------------------------------------------------
@dataclass
class Row:
    id: str
    name: str
    cases: list[str]
    judge: Callable[["Row", dict[str, dict[str, Any]]], tuple[str, str]]
    limit: str = ""


def _case(strategy: str, compiled: bool = False, plant: Optional[str] = None) -> dict[str, Any]:
    cid = strategy + ("+compiled" if compiled else "") + (f"+{plant}" if plant else "")
    return {"id": cid, "strategy": strategy, "compiled": compiled, "plant": plant}


def _why(c: dict[str, Any]) -> str:
    if "error" in c:
        return c["error"]
    if not c["finite"]:
        return "non-finite (NaN reached the loss or the parameters)"
    return f"loss rel {c['loss_rel']:.1e}, norm rel {c['norm_rel']:.1e}, param diff {c['param_diff']:.1e}"


def judge_exact(row: Row, done: dict[str, dict[str, Any]]) -> tuple[str, str]:
    cases = [done[c] for c in row.cases]
    bad = [(cid, c) for cid, c in zip(row.cases, cases) if not c["ok"]]
    good = [c for c in cases if c["ok"]]
    text = f"{len(good)}/{len(cases)} exact"
    if good:
        text += (f"; worst loss rel {max(c['loss_rel'] for c in good):.1e}, norm rel {max(c['norm_rel'] for c in good):.1e}, "
                 f"param diff {max(c['param_diff'] for c in good):.1e}")
    if bad:
        text += "; " + "; ".join(f"{cid}: {_why(c)}" for cid, c in bad[:6])
    return (PASS if not bad else FAIL), text


def judge_planted(row: Row, done: dict[str, dict[str, Any]]) -> tuple[str, str]:
    cases = [done[c] for c in row.cases]
    caught = [c for c in cases if not c["ok"]]
    text = f"caught in {len(caught)}/{len(cases)} planted runs (each must FAIL): " + "; ".join(
        f"{cid.split('+')[0]} {_why(c)}" for cid, c in zip(row.cases, cases))
    return (PASS if len(caught) == len(cases) else FAIL), text


def judge_compiled(row: Row, done: dict[str, dict[str, Any]]) -> tuple[str, str]:
    c = done[row.cases[0]]
    graphs = c.get("graph_collectives", {})
    kinds = {key.split()[1].split("/")[0] for key in graphs}
    has = {"all_gather", "reduce_scatter"} <= kinds
    text = (", ".join(f"{k} {v}" for k, v in sorted(graphs.items())) or "no collective in any graph") + "; " + (
        "exact: " + _why(c) if c["ok"] else _why(c))
    return (PASS if c["ok"] and has else FAIL), "graphs hold " + text


def plan_rows(device: str, strategies: list[str], plant: Optional[str],
              compiled: bool = True) -> tuple[list[Row], list[list[dict[str, Any]]]]:
    """Part (d)'s rows and the cases of its two worlds. ``strategies``: those trained exactly (the
    core ones among them first); ``plant``: a bug planted in every case (``--plant``);
    ``compiled=False`` leaves out the compiled block (tests: it is the slow case on CPU)."""
    from .plants import PLANTS, plant_error

    core = [s for s in CORE if s in strategies]
    rest = [s for s in strategies if s not in CORE]
    rows = [Row("d.core", f"{', '.join(core)} exact vs one process (2x2, vocab 258, A=2)", core, judge_exact,
                "loss/norm rel, param abs")] if core else []
    world1 = [_case(s) for s in core]
    for p in PLANTS:
        if plant_error(p, device) is None:
            cases = [_case(s, plant=p) for s in PLANTED]
            rows.append(Row(f"d.plant.{p}", f"self-test: planted {p} makes {', '.join(PLANTED)} FAIL",
                            [c["id"] for c in cases], judge_planted, "every planted run fails"))
            world1 += cases
    world2 = [_case(COMPILED, compiled=True)] if compiled else []
    if compiled:
        rows.append(Row("d.compiled", f"one compiled block ({COMPILED} layers.0, graph passes): collectives in graph, exact",
                        [world2[0]["id"]], judge_compiled, "all_gather + reduce_scatter in graph"))
    if rest:
        rows.append(Row("d.rest", f"the other {len(rest)} strategies exact", rest, judge_exact, "loss/norm rel, param abs"))
        world2 += [_case(s) for s in rest]
    for c in world1 + world2:
        c["plant"] = c["plant"] or plant
    return rows, [w for w in (world1, world2) if w]


class Tracker:
    """Collects the ranks' case results, compares each finished case with the reference and emits
    a row of ``part`` as soon as all of its cases are in. A finished case is ``workload.compare``'s
    result plus the seconds, the stand-in's counts and every rank's message without its
    parameters (``ranks``); a case a rank reported as an ``error`` is not ok."""

    def __init__(self, part: str, rows: list[Row], emit: Emitter, ref: dict[str, Any],
                 tol: tuple[float, float, float], world: int) -> None:
        self.part, self.rows, self.emit, self.ref, self.tol, self.world = part, rows, emit, ref, tol, world
        self.parts: dict[str, dict[int, dict[str, Any]]] = {}
        self.done: dict[str, dict[str, Any]] = {}
        self.emitted: set[str] = set()

    def on_message(self, rank: int, msg: dict[str, Any]) -> None:
        from .workload import compare

        got = self.parts.setdefault(msg["case"], {})
        got[rank] = msg
        if msg["case"] in self.done or (len(got) < self.world and not msg.get("race")):
            return  # a reported race completes its case at once: the other ranks may be stuck behind it
        errors = [m["error"] for m in got.values() if "error" in m]
        c: dict[str, Any] = {"ok": False, "finite": False, "error": errors[0]} if errors else compare(self.ref, got, self.tol)
        first = got[min(got)]
        c.update(seconds=max(m.get("seconds", 0.0) for m in got.values()), standin=first.get("standin", {}),
                 graph_collectives=first.get("graph_collectives", {}),
                 ranks={r: {k: v for k, v in m.items() if k not in ("params", "case")} for r, m in got.items()})
        self.done[msg["case"]] = c
        self._emit_ready()

    def _emit_ready(self) -> None:
        for row in self.rows:
            if row.id not in self.emitted and all(c in self.done for c in row.cases):
                status, text = row.judge(row, self.done)
                self._emit(row, status, text)

    def _emit(self, row: Row, status: str, text: str) -> None:
        self.emitted.add(row.id)
        cases = {c: {k: v for k, v in self.done[c].items() if k not in ("losses", "ranks")} for c in row.cases
                 if c in self.done}
        self.emit(check(self.part, row.id, row.name, status, text, row.limit, cases=cases))

    def all_emitted(self) -> bool:
        """Every row has been reported: the world may stop."""
        return all(row.id in self.emitted for row in self.rows)

    def finish(self, case_ids: list[str], why: str) -> None:
        """Rows of these cases that never completed: FAIL with ``why`` (and what did finish)."""
        for row in self.rows:
            if row.id not in self.emitted and any(c in case_ids for c in row.cases):
                missing = [c for c in row.cases if c not in self.done]
                failed = [f"{c}: {self.done[c]['error']}" for c in row.cases if "error" in self.done.get(c, {})]
                self._emit(row, FAIL, f"{why} (missing {', '.join(missing)})" + "".join(f"; {f}" for f in failed[:2]))


def worker_d(emit: Emitter, device: str, timeout_s: float, strategies: Optional[list[str]] = None,
             plant: Optional[str] = None, compiled: bool = True) -> None:
    """The parent of part (d): the reference (on ``device``), then the two worlds (``plan_rows``)."""
    from .plants import plant_error
    from .workload import WORLD, reference
    from .world import run_world

    t0 = time.monotonic()
    names = strategies or d_strategies(None)
    rows, worlds = plan_rows(device, names, plant, compiled)
    if plant_error("issue-wait", device):
        emit(check("d", "d.plant.issue-wait", "self-test: planted issue-wait makes NNN, IIG, GGG FAIL", SKIP,
                   "CPU has no streams: the side stream's wait for the compute stream exists on CUDA only"))
    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
    ref = reference(device)
    tracker = Tracker("d", rows, emit, ref, STREAMS_TOL[device], WORLD)
    payload = {"device": device, "delay_ms": DELAY_MS if device == "cuda" else 0.0,
               "result_ms": RESULT_MS if device == "cuda" else 0.0}
    for cases in worlds:
        left = timeout_s - (time.monotonic() - t0) - MARGIN_S
        ids = [c["id"] for c in cases]
        if left <= 0:
            tracker.finish(ids, "not reached: no time left in the part's timeout")
            continue
        outcome = run_world(WORLD, "tools.gpu_check.ranks:rank_main", dict(payload, cases=cases), device, left,
                            tracker.on_message)
        print(f"world of {len(cases)} cases: {'done' if outcome.done else outcome.why()} in {outcome.seconds:.1f} s",
              flush=True)
        tracker.finish(ids, outcome.why())
