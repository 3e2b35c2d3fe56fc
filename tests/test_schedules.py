"""Pipeline schedules as data: generators, validator, simulator (autopar/analysis/schedules.py).

The simulator runs each rank's action list in order with F=1, B=2 (I=W=1) time units; the
reference bubbles are the textbook ones: (P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(vM+P-1) for
interleaved 1F1B, and for ZB-H1 an idle time of (P-1)(F+I-W), a third of 1F1B's (P-1)(F+I+W).
"""

from __future__ import annotations

import pytest

from autopar.analysis import schedules as S

SIZES = [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32)]


@pytest.mark.parametrize("p,m", SIZES)
def test_bubbles_match_theory(p, m):
    for name, make, v in [("gpipe", S.gpipe, 1), ("1f1b", S.one_f_one_b, 1), ("zb", S.zb_h1, 1),
                          ("interleaved", lambda p, m: S.interleaved(p, m, 2), 2),
                          ("interleaved", lambda p, m: S.interleaved(p, m, 4), 4)]:
        sched = make(p, m)
        S.validate(sched)
        tl = S.simulate(sched)
        assert tl.bubble == pytest.approx(S.theory_bubble(name, p, m, v), abs=1e-12), (name, p, m, v)


@pytest.mark.parametrize("p,m", SIZES)
def test_zero_bubble_idles_a_third_of_1f1b(p, m):
    idle = {}
    for name, make in [("1f1b", S.one_f_one_b), ("zb", S.zb_h1)]:
        tl = S.simulate(make(p, m))
        idle[name] = p * tl.makespan - sum(tl.busy)
    assert idle["zb"] == pytest.approx(idle["1f1b"] / 3)


@pytest.mark.parametrize("p,m", SIZES)
def test_activations_in_flight(p, m):
    assert S.simulate(S.gpipe(p, m)).peak_in_flight == [m] * p  # GPipe holds every micro-batch
    assert S.simulate(S.one_f_one_b(p, m)).peak_in_flight == [p - r for r in range(p)]  # at most P
    assert max(S.simulate(S.zb_h1(p, m)).peak_in_flight) == p  # ZB-H1: 1F1B's peak


def test_validator_rejects_bad_schedules():
    good = S.one_f_one_b(2, 4)
    missing = S.Schedule("x", 2, 4, 1, [good.actions[0][:-1], good.actions[1]])
    with pytest.raises(S.ScheduleError, match="incomplete: no backward of stage 0 on micro-batch 3"):
        S.validate(missing)
    wrong = S.Schedule("x", 2, 4, 1, [good.actions[0] + [("F", 1, 0)], good.actions[1]])
    with pytest.raises(S.ScheduleError, match=r"belongs on rank 1"):
        S.validate(wrong)
    twice = S.Schedule("x", 2, 4, 1, [good.actions[0] + [("F", 0, 0)], good.actions[1]])
    with pytest.raises(S.ScheduleError, match="appears twice"):
        S.validate(twice)
    # the last stage runs a backward before the forward it needs: every rank ends up waiting
    r1 = list(good.actions[1])
    r1.insert(0, r1.pop(r1.index(("B", 1, 0))))
    with pytest.raises(S.ScheduleError, match="deadlocks: every rank waits — rank 0 at .*rank 1 at \\('B', 1, 0\\)"):
        S.validate(S.Schedule("x", 2, 4, 1, [good.actions[0], r1]))
    split = [[("W", 0, i) if a == ("B", 0, i) else a for a in good.actions[0] for i in [a[2]]], good.actions[1]]
    with pytest.raises(S.ScheduleError, match="split backward needs both I and W"):
        S.validate(S.Schedule("x", 2, 4, 1, split))


def test_schedule_argument_errors():
    with pytest.raises(S.ScheduleError, match="3 micro-batches cannot fill a 4-stage pipeline"):
        S.one_f_one_b(4, 3)
    with pytest.raises(S.ScheduleError, match="multiple of the ranks"):
        S.interleaved(4, 6, 2)


def test_gantt_chart(tmp_path):
    out = S.gantt({n: (s, S.simulate(s)) for n, s in [("1F1B", S.one_f_one_b(4, 8)), ("ZB-H1", S.zb_h1(4, 8))]},
                  str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").stat().st_size > 10_000 and out.endswith("g.png")


def test_interleaving_divides_the_idle_time_by_v():
    base = S.simulate(S.one_f_one_b(4, 8))
    for v in (2, 4):
        tl = S.simulate(S.interleaved(4, 8, v))
        assert 4 * tl.makespan - sum(tl.busy) == pytest.approx((4 * base.makespan - sum(base.busy)) / v)
        assert sum(tl.busy) == pytest.approx(sum(base.busy))  # the same work, cut in v chunks
