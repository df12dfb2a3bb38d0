"""bench/convergence_warm.py --h50 --min-lr-ratio: every format gets the same inner schedule, the report says which,
and a ratio outside [0, 1] is refused before anything trains."""

from __future__ import annotations

import pytest
from support.bench_scripts import load_bench_script

convergence = load_bench_script("convergence")
warm = load_bench_script("convergence_warm")


def test_every_format_decays_its_inner_lr_alike_and_constant_stays_the_default() -> None:
    settings = [warm.h50_setting(fmt, 1337, 300, steps=1000, min_lr_ratio=0.1) for fmt in warm.H50_FORMATS]
    assert {s.min_lr_ratio for s in settings} == {0.1}
    for s in settings:
        assert convergence.inner_lr(s, 1) == pytest.approx(s.lr, rel=1e-5)
        assert convergence.inner_lr(s, 1000) == pytest.approx(0.1 * s.lr)
        assert convergence.inner_lr(s, 500) == pytest.approx(0.55 * s.lr)
    constant = warm.h50_setting("topk", 1337, 300, steps=1000)
    assert constant.min_lr_ratio == 1.0 and convergence.inner_lr(constant, 1000) == constant.lr


def test_the_report_names_the_schedule() -> None:
    def report(ratio: float) -> str:
        s = warm.h50_setting("none", 1337, 300, steps=100, min_lr_ratio=ratio)
        result = convergence.Result("diloco", s, [(0, 2.0), (50, 1.9), (100, 1.8)])
        return " ".join(warm.h50_report([result], [1337])["notes"])

    assert "constant" in report(1.0)
    assert f"cosine to {3e-3 * 0.1:g}" in report(0.1)


@pytest.mark.parametrize("ratio", ["-0.1", "1.5"])
def test_a_ratio_outside_zero_to_one_is_refused_naming_the_option(ratio: str) -> None:
    with pytest.raises(SystemExit, match="--min-lr-ratio"):
        warm.main(["--h50", "--min-lr-ratio", ratio])


def test_set_changes_a_setting_in_the_fields_own_type() -> None:
    changed = warm.overrides(["outer_lr=2", "outer_momentum=0", "nesterov=false", "topk_chunk=256",
                              "corpus=pycorpus"])
    assert changed == {"outer_lr": 2.0, "outer_momentum": 0.0, "nesterov": False, "topk_chunk": 256,
                       "corpus": "pycorpus"}
    assert isinstance(changed["outer_lr"], float) and isinstance(changed["topk_chunk"], int)
    assert warm.format_name(convergence.Setting(**{**warm.PAPER, **changed})) == "fp32, outer lr 2 Nesterov 0"


@pytest.mark.parametrize(("pair", "says"), [("bogus=1", "FIELD one of"), ("outer_lr", "FIELD=VALUE"),
                                            ("outer_lr=fast", "takes a number"),
                                            ("nesterov=maybe", "takes true or false"),
                                            ("topk_chunk=2.5", "takes a whole number")])
def test_a_bad_set_is_refused_before_anything_trains(pair: str, says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        warm.main(["--h50", "--formats", "topk", "--set", pair])
