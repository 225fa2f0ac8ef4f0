"""StepLead: when the step scheduled now starts on the device, from chained read-backs."""

from __future__ import annotations

import pytest

from siesta.core.step_lead import StepLead


def test_the_lead_is_the_shorter_recent_step_left_after_the_last_read_back() -> None:
    lead = StepLead()
    assert lead.seconds(now=0.0) == 0.0, "nothing measured"
    lead.read_back(chained=True, now=1.000)
    assert lead.seconds(now=1.001) == 0.0, "one read-back is no interval yet"
    lead.read_back(chained=True, now=1.013)  # a 13 ms step (an extend)
    lead.read_back(chained=True, now=1.022)  # a 9 ms one
    assert lead.seconds(now=1.024) == pytest.approx(0.007), "the 9 ms step less the 2 ms since"
    lead.read_back(chained=True, now=1.035)  # 13 ms again: the 9 ms one is still among the last two
    assert lead.seconds(now=1.035) == pytest.approx(0.009)
    assert lead.seconds(now=1.100) == 0.0, "overdue: the step starts as soon as it is launched"


def test_a_read_back_with_no_step_behind_it_forgets_the_last_one() -> None:
    lead = StepLead()
    for t in (1.0, 1.01, 1.02):
        lead.read_back(chained=True, now=t)
    lead.read_back(chained=False, now=5.0)  # the device idled: no step is running now
    assert lead.seconds(now=5.0) == 0.0
    lead.read_back(chained=True, now=6.0)
    assert lead.seconds(now=6.0) == pytest.approx(0.01), "the intervals measured before still hold"
    lead.read_back(chained=True, now=6.02)
    assert list(lead.intervals) == pytest.approx([0.01, 0.02]), "no interval spans the idle time"
