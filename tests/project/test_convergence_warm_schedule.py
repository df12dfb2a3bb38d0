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
