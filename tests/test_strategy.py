"""Strategy strings and per-tensor policies (no processes needed)."""
import pytest
import torch

from paro_fsdp import ALL_STRATEGIES, Level, Strategy
from paro_fsdp.strategy import resolve_policy

NAMED = [
    (n, torch.nn.Parameter(torch.zeros(2)))
    for n in ("emb.weight", "layers.0.wq.weight", "layers.0.norm.weight", "out.weight")
]


def test_all_27_parse_and_round_trip():
    assert len(ALL_STRATEGIES) == 27 and len(set(ALL_STRATEGIES)) == 27
    for s in ALL_STRATEGIES:
        st = Strategy.parse(s.lower())
        assert st.name == s and (st.p, st.g, st.os) == tuple(Level(c) for c in s)


@pytest.mark.parametrize("bad", ["IXG", "II", "IIGG", "", "abc"])
def test_unknown_letters_name_the_fix(bad):
    with pytest.raises(ValueError, match="three letters from N, I, G"):
        Strategy.parse(bad)


def test_known_names():
    assert Strategy.parse("GGG").known_as.startswith("ZeRO-3")
    assert Strategy.parse("III").known_as.startswith("MiCS")
    assert Strategy.parse("IIG").known_as == "PaRO"


def test_dict_policy_first_match_wins_and_default_covers_rest():
    out = resolve_policy({"layers.*.norm.*": "NNN", "layers.*": "GGG", "default": "IIG"}, NAMED)
    assert {k: v.name for k, v in out.items()} == {
        "emb.weight": "IIG", "layers.0.wq.weight": "GGG", "layers.0.norm.weight": "NNN", "out.weight": "IIG",
    }


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"match no parameter"):
        resolve_policy({"layers.*.wq.weigth": "GGG", "default": "IIG"}, NAMED)


def test_dict_without_default_must_cover_everything():
    with pytest.raises(ValueError, match="add a 'default' entry"):
        resolve_policy({"layers.*": "GGG"}, NAMED)


def test_callable_policy():
    out = resolve_policy(lambda name, p: "ING" if "emb" in name else Strategy.parse("NIG"), NAMED)
    assert out["emb.weight"].name == "ING" and out["out.weight"].name == "NIG"
