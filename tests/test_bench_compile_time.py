"""tools.bench.compile_time's command line and table (the measurement itself takes minutes of
compiling: README "torch.compile and the graph passes" has a run's table)."""
from __future__ import annotations

import pytest

from tools.bench import compile_time
from paro_fsdp.models.llama import FLAVORS


def test_unknown_variant_is_refused_with_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        compile_time.main(["--variants", "paro-model,fsdp3"])
    assert exit_.value.code == 2
    assert "unknown variant(s) ['fsdp3']; valid: paro-model, paro-blocks, fsdp2" in capsys.readouterr().err


def test_table_puts_each_first_step_against_fsdp2_of_the_same_run():
    cfg = compile_time.Config(FLAVORS["debug"], 8, 128, "IIG", ("paro-model", "fsdp2"))
    row = dict(second=0.3, graphs=5, recompiles=0, fx_hit=0, fx_miss=9)
    rows = {("paro-model", "cold"): dict(row, first=90.0), ("paro-model", "warm"): dict(row, first=12.0, fx_hit=9),
            ("fsdp2", "cold"): dict(row, first=30.0), ("fsdp2", "warm"): dict(row, first=8.0)}
    lines = compile_time.table(cfg, rows).splitlines()
    cold = next(line for line in lines if line.startswith("paro-model   cold"))
    warm = next(line for line in lines if line.startswith("paro-model   warm"))
    assert cold.split()[2:4] == ["90.0", "3.00"] and warm.split()[2:4] == ["12.0", "1.50"]
    assert warm.split()[-2:] == ["9", "9"]  # the warm run's FX-graph cache hits beside its misses
    assert "dim 64 x 4 layers" in lines[0] and "PaRO IIG" in lines[0]
