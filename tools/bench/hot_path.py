"""``python -m tools.bench.hot_path``: what one micro-step costs beside the model's own compute, in
counts that do not depend on the machine's load: data-movement ops and the bytes they write,
allocations (count and bytes, the allocator's own events), collectives, and Python calls into the
engine's package. For PaRO strategies and Megatron-FSDP (in its own venv), each on 4 local gloo
ranks under torchrun (rank 0 reported), the bench's Llama in ``tools.bench``'s headline shape:

    .venv/bin/python -m tools.bench.hot_path --strategies III,IIG --peers mfsdp-hsdp

Rows: a steady micro-step without gradient sync (the 2nd of A = 4 of the 2nd step), the last
micro-step (sync: the boundary's reductions), and the plain model on one process (the same
micro-batch, no engine): what every system pays. Counts come from a TorchDispatchMode (ops as the
dispatcher sees them; a DTensor op is counted once, on its local tensor), torch.profiler's
memory events (every allocation) and ``sys.setprofile`` (calls into the engine's files).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Callable

TAG = "HOT_PATH_JSON "
SHAPE = dict(dim=512, layers=4, heads=8, kv_heads=4, ffn=1536, vocab=2048, seq=128, batch=2)
COPY = {"copy_", "_to_copy", "clone", "cat", "index", "index_put_", "_index_put_impl_", "index_select", "add_",
        "split_with_sizes_copy", "_foreach_copy_", "stack", "div_", "mul_", "_unsafe_index_put", "new_zeros", "zero_",
        "fill_", "zeros", "zeros_like", "constant_pad_nd"}
ALLOC = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "zeros", "new_zeros", "zeros_like"}


def counting_mode():
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()
            self.bytes: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            ns = func.namespace
            if ns in ("_c10d_functional", "c10d"):
                name = f"{ns}.{name}"
            elif func.is_view or name not in COPY | ALLOC:
                return out
            self.ops[name] += 1
            written = (kwargs or {}).get("out") if out is None else out  # split_with_sizes_copy: into ``out=``
            for t in (written if isinstance(written, (list, tuple)) else [written]):
                if isinstance(t, torch.Tensor):
                    t = t._local_tensor if isinstance(t, DTensor) else t
                    self.bytes[name] += t.numel() * t.element_size()
            return out

    return Count()


def _walk(nodes: list) -> Any:
    for n in nodes:
        yield n
        yield from _walk(n.children)


def measure(fn: Callable[[], None], pkg_dir: str, counted: bool = True) -> dict[str, Any]:
    """Run ``fn`` for the clocks (CPU time of the process and of this thread, wall time, page
    faults), then (``counted``) again under the counters."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    calls = Counter()

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(pkg_dir):
            calls[frame.f_code.co_name] += 1

    mode = counting_mode()
    r0, t0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    fn()  # page faults and CPU time without the counters' own work
    r1, t1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.thread_time(), time.perf_counter()
    faults = r1.ru_minflt - r0.ru_minflt
    cpu = {"cpu_ms": 1e3 * (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime), "main_ms": 1e3 * (t1 - t0),
           "wall_ms": 1e3 * (w1 - w0)}
    if not counted:
        return {"ops": {}, "op_bytes": {}, "allocs": 0, "alloc_bytes": 0, "allocs_64k": 0, "alloc_bytes_64k": 0,
                "py_calls": 0, "page_faults": faults, **cpu, "py_top": [], "alloc_by_op": {}}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        sys.setprofile(prof)
        try:
            with mode:
                fn()
        finally:
            sys.setprofile(None)
    allocs, where = [], Counter()
    for n in _walk(p.profiler.kineto_results.experimental_event_tree()):
        if n.tag == _EventType.Allocation and n.extra_fields.alloc_size > 0:
            allocs.append(n.extra_fields.alloc_size)
            if allocs[-1] >= 1 << 16:  # by the op that allocated it
                where[n.parent.name if n.parent is not None else "(no op)"] += allocs[-1]
    big = [a for a in allocs if a >= 1 << 16]
    return {"ops": dict(mode.ops), "op_bytes": dict(mode.bytes), "allocs": len(allocs), "alloc_bytes": sum(allocs),
            "allocs_64k": len(big), "alloc_bytes_64k": sum(big), "py_calls": sum(calls.values()),
            "page_faults": faults, **cpu, "py_top": calls.most_common(10), "alloc_by_op": dict(where.most_common(8))}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from tools.bench.peers.worker import batch, make_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ns = argparse.Namespace(**SHAPE, model="llama", optimizer="adamw", max_norm=1.0)
    A = args.accum
    results: dict[str, Any] = {}
    if args.target == "local":  # the model alone on one process: what every system pays
        model = make_model(ns)

        def micro() -> None:
            model(batch(ns, rank, 0, 1)).loss.backward()
        micro()
        results["model alone"] = measure(micro, "/nonexistent")
    elif args.target.startswith("mfsdp"):
        from tools.bench.peers import PEERS
        from tools.bench.peers import patches as P
        from tools.bench.peers.mfsdp_peer import build

        peer = PEERS[args.target]
        run = build(peer, ns, make_model(ns), 2, P.active(peer, set()))
        fmodel, opt = run.roots
        import megatron_fsdp
        pkg = os.path.dirname(megatron_fsdp.__file__)

        def micro(i: int, a: int) -> None:
            fmodel.set_model_auto_sync(a == A - 1)
            (fmodel(batch(ns, rank, i, a)).loss / A).backward()

        from tools.bench.peers.mfsdp_peer import clip_grad_norm
        params = list(fmodel.parameters())
        results.update(_steps(micro, lambda: (clip_grad_norm(params, 1.0), opt.step(), opt.zero_grad()), A, pkg))
    else:
        from paro_fsdp import init_paro_mesh, paro_shard
        import paro_fsdp

        model = paro_shard(make_model(ns), init_paro_mesh(2), args.target)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)

        def micro(i: int, a: int) -> None:
            model.set_requires_gradient_sync(a == A - 1)
            (model(batch(ns, rank, i, a)).loss / A).backward()

        results.update(_steps(micro, lambda: (torch.nn.utils.clip_grad_norm_(params, 1.0), opt.step(), opt.zero_grad()),
                              A, os.path.dirname(paro_fsdp.__file__)))
    if args.target != "local":  # CPU times: the mean over ranks (the counts are rank 0's)
        keys = [(row, k) for row in sorted(results) for k in ("cpu_ms", "main_ms")]
        t = torch.tensor([results[row][k] for row, k in keys], dtype=torch.float64)
        dist.all_reduce(t)
        for (row, k), v in zip(keys, (t / dist.get_world_size()).tolist()):
            results[row][k] = v
    if rank == 0:
        print(TAG + json.dumps({args.target: results}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _steps(micro: Callable[[int, int], None], step: Callable[[], None], A: int, pkg: str) -> dict[str, Any]:
    """Step 0 warms up; in step 1 (rows), micro-step 1 (no sync), the last (sync) and the optimizer
    step (clip, step, zero_grad, as the bench) are counted; micro-steps 0 and 1 and the last, and
    the optimizer step, run twice (once for the clock, once under the counters)."""
    out = {}
    for i in range(2):
        for a in range(A):
            if i == 1 and a in (1, A - 1):
                out["micro (no sync)" if a == 1 else "last micro (sync)"] = measure(lambda: micro(i, a), pkg)
            else:
                micro(i, a)
        if i == 1:
            out["optimizer step (clock only)"] = measure(step, pkg, counted=False)
        else:
            step()
    return out


def launch(target: str, python: str, accum: int) -> dict[str, Any]:
    torchrun = os.path.join(os.path.dirname(python), "torchrun")
    nproc = 1 if target == "local" else 4
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "-m", "tools.bench.hot_path", "--target", target,
           "--accum", str(accum)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in res.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    raise RuntimeError(f"{target}: no result\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def report(all_rows: dict[str, dict[str, Any]]) -> None:
    """One line per row: data-movement ops (count, MiB written; allocation ops apart), allocations
    (all; of 64 KiB and more: count, MiB), collectives, Python calls into the package, minor page
    faults, CPU ms of the process (all its threads: gloo's too) and of the main thread (means over
    ranks), wall ms. Counts are load-independent; CPU and wall times are not (other processes on
    the cores, memory bandwidth): compare them only within one run."""
    head = ("moves", "MiB", "allocs", ">=64K", "MiB", "colls", "py", "faults", "cpu ms", "main", "wall")
    print(f"\n{'system / micro-step':<34}" + "".join(f"{h:>8}" for h in head))
    for target, rows in all_rows.items():
        for label, r in rows.items():
            moves = [k for k in r["ops"] if "c10d" not in k and k not in ALLOC]
            colls = sum(v for k, v in r["ops"].items() if "c10d" in k and "wait" not in k)
            cells = (sum(r["ops"][k] for k in moves), sum(r["op_bytes"].get(k, 0) for k in moves) / 2**20, r["allocs"],
                     r["allocs_64k"], r["alloc_bytes_64k"] / 2**20, colls, r["py_calls"], r["page_faults"],
                     r["cpu_ms"], r["main_ms"], r["wall_ms"])
            print(f"{target + ': ' + label:<34}" + "".join(f"{c:>8.0f}" if isinstance(c, float) else f"{c:>8}"
                                                          for c in cells))
    print("\nper op (count / MiB written), allocations >= 64 KiB by the op that made them (MiB), top calls:")
    for target, rows in all_rows.items():
        for label, r in rows.items():
            if not r["ops"]:
                continue
            print(f"  {target + ': ' + label}")
            ops = sorted(r["ops"].items())
            print("    " + ", ".join(f"{k} {v}/{r['op_bytes'].get(k, 0) / 2**20:.1f}" for k, v in ops))
            print("    " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["alloc_by_op"].items()))
            if r["py_top"]:
                print("    " + ", ".join(f"{k} {v}" for k, v in r["py_top"]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.hot_path", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategies", default="III,IIG")
    ap.add_argument("--peers", default="mfsdp-hsdp", help="comma-separated Megatron-FSDP peers ('' for none)")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--target", help=argparse.SUPPRESS)  # one run's worker, under torchrun
    ap.add_argument("--json", help="write the counts here too")
    args = ap.parse_args(argv)
    if args.target:
        return worker(args)
    from tools.bench.peers import PEERS, venv_python

    rows: dict[str, Any] = {}
    here = sys.executable
    for t in ["local", *filter(None, args.strategies.split(",")), *filter(None, args.peers.split(","))]:
        py = venv_python(PEERS[t].release) if t in PEERS else here
        rows.update(launch(t, py, args.accum))
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
