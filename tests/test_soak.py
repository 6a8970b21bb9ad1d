"""Soak (slow set): 2,000 steps of the debug model on 4 gloo ranks with a checkpoint every 100
steps (keep 3). Nothing may grow once the run has settled: resident memory after step 200
grows < 5% to the end, open files and process groups stay flat, and 3 checkpoints remain."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
for p in (str(REPO), str(Path(__file__).parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

from dist_harness import run_world  # noqa: E402

STEPS, SETTLED = 2000, 200


def _sample() -> tuple[float, int, int]:
    from torch.distributed import distributed_c10d as c10d

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return rss, len(os.listdir("/proc/self/fd")), len(c10d._world.pg_map)


def soak(tmp: str) -> dict[str, Any]:
    from paro_fsdp.train.checkpoint import list_checkpoints
    from paro_fsdp.train.config_parse import parse_args
    from train import Trainer

    from test_faults import ARGS

    cfg, _ = parse_args(ARGS + ["--training.steps", str(STEPS), "--metrics.log_freq", "100", "--checkpoint.enable",
                                "--checkpoint.interval", "100", "--checkpoint.keep_latest_k", "3",
                                "--job.dump_folder", tmp])
    trainer = Trainer(cfg)
    samples: list[tuple[int, float, int, int, int]] = []
    done = threading.Event()

    def sampler() -> None:
        while not done.is_set():
            samples.append((trainer.state.step, *_sample(), len(list_checkpoints(trainer.checkpointer.folder))))
            time.sleep(0.5)

    thread = threading.Thread(target=sampler, daemon=True)
    start = time.perf_counter()
    thread.start()
    losses = trainer.train()
    done.set()
    thread.join()
    samples.append((trainer.state.step, *_sample(), len(list_checkpoints(trainer.checkpointer.folder))))
    trainer.close()
    return {"samples": samples, "losses": losses, "seconds": time.perf_counter() - start,
            "kept": sorted(list_checkpoints(os.path.join(tmp, "checkpoint")))}


@pytest.mark.slow
def test_soak_2000_steps_nothing_grows(tmp_path):
    results = run_world(4, "test_soak:soak", str(tmp_path), timeout=3600)
    lines = []
    for rank, r in enumerate(results):
        settled = [s for s in r["samples"] if s[0] >= SETTLED]
        assert settled and r["samples"][-1][0] == STEPS
        rss0, fds0, pgs0 = settled[0][1:4]
        rss_end, fds_max, pgs_max = settled[-1][1], max(s[2] for s in settled), max(s[3] for s in settled)
        growth = (rss_end - rss0) / rss0
        lines.append(
            f"rank {rank}: rss {rss0:.1f} -> {rss_end:.1f} MiB ({100 * growth:+.2f}%), open files {fds0} -> max "
            f"{fds_max}, process groups {pgs0} -> max {pgs_max}, {r['seconds']:.0f} s"
        )
        assert growth < 0.05, lines[-1]
        assert fds_max <= fds0 + 2 and pgs_max == pgs0, lines[-1]  # +2: a checkpoint file open at the sample
        assert max(s[4] for s in r["samples"]) <= 4  # 3 kept, a 4th only between its rename and the prune
    assert results[0]["kept"] == [1800, 1900, 2000]
    losses = results[0]["losses"]
    assert losses[STEPS] < losses[100]
    print("\n".join(lines))
