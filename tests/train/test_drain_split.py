"""The pipeline's drain, measured: a rank waiting in the engine's closing loss sum before
the last rank of its pipeline posted its part waits for that stage's last backward
(pp_bubble); only the wait after the last post is the collective's own (dp_comm).

Hand-made rank reports (the shape plait.train.step_breakdown.StepTotals.report gives),
one recorded step each, times in seconds of one host clock. Expected values by hand:
rank (pp 1) posts at 4.9, the last post (pp 0) is at 5.0, its closing ends at 5.002:
drain 0.1 of its 0.102 s closing, the other 0.002 s dp_comm. Chimera's replica exchange
is a pair's: its wait before the partner's post is drain too. Arithmetic in float64 on
numbers of order 1: 1e-12 relative (1e-9 where a sum of ~1e-3 s differences of ~3 s
times loses digits: 3 s / 2^52 ~ 7e-16 s each, over 45 ms ~ 1e-13 relative).
"""

from __future__ import annotations

import pytest

from plait.names.step_parts import DP_COMM, PP_BUBBLE, STEP_PARTS
from plait.train.step_breakdown import measured_breakdown


def _rank(rank: int, pp: int, exchanges: list | None, *, dp: int = 0, dp_comm_s: float = 0.0,
          host: str = "h") -> dict:
    """A rank whose steady step is ``dp_comm_s`` of dp communication (the engine's closing
    exchanges part of it) and nothing else; ``exchanges``: its closing (what, posted_s, end_s),
    as the engine records them, or None for a report from before they were recorded."""
    closing_s = sum(end_s - posted_s for _, posted_s, end_s in exchanges or ())
    parts = {name: 0.0 for name in ("compute_s", "tp_comm_s", "pp_comm_s", "receive_s",
                                    "optimizer_s", "data_s", "other_s")}
    parts.update(dp_comm_s=dp_comm_s, wall_s=dp_comm_s)
    message = ([], []) if exchanges is None else ([], [], (closing_s, exchanges))
    return {"rank": rank, "coords": {"dp": dp, "tp": 0, "pp": pp}, "steps": 2, "host": host,
            "steady": {"steps": 1, "parts_s": parts, "stage_compute_s": {}, "closing_s": closing_s},
            "messages": [message]}


def _pipeline(dp: int = 0, first: int = 0) -> list[dict]:
    last_post = _rank(first, 0, [("loss", 5.0, 5.001)], dp=dp, dp_comm_s=0.004)
    drained = _rank(first + 1, 1, [("loss", 4.9, 5.002)], dp=dp, dp_comm_s=0.110)
    return [last_post, drained]


def test_the_wait_before_the_last_post_is_bubble():
    measured = measured_breakdown(_pipeline())
    rows = measured["per_rank_ms"]
    assert rows["1"][PP_BUBBLE] == pytest.approx(100.0, rel=1e-12)
    assert rows["1"][DP_COMM] == pytest.approx(10.0, rel=1e-12)  # 110 ms - the 100 ms drain
    assert rows["0"][PP_BUBBLE] == pytest.approx(0.0, abs=1e-12) and rows["0"][DP_COMM] == pytest.approx(4.0, rel=1e-12)
    for row in rows.values():
        assert sum(row[part] for part in STEP_PARTS) == pytest.approx(row["wall"], rel=1e-12)
    assert "last post" in measured["closing_split"]


def test_pipelines_are_apart_and_older_reports_unchanged():
    # a second pipeline (dp 1) whose last post is much later does not make the first one's ranks wait
    other = _pipeline(dp=1, first=2)
    other[0]["messages"] = [([], [], (0.001, [("loss", 9.0, 9.001)]))]
    rows = measured_breakdown(_pipeline() + other)["per_rank_ms"]
    assert rows["1"][PP_BUBBLE] == pytest.approx(100.0, rel=1e-12)
    assert rows["3"][PP_BUBBLE] == pytest.approx(102.0, rel=1e-12)  # its whole closing: the cap is the closing
    assert rows["3"][DP_COMM] == pytest.approx(8.0, rel=1e-12)
    # no closing times recorded (an older report): the closing stays dp_comm
    old = [_rank(0, 0, None, dp_comm_s=0.004), _rank(1, 1, None, dp_comm_s=0.110)]
    assert measured_breakdown(old)["per_rank_ms"]["1"][DP_COMM] == pytest.approx(110.0, rel=1e-12)


def test_ranks_on_several_hosts_keep_the_closing_in_dp_comm():
    ranks = _pipeline()
    ranks[1]["host"] = "other"
    measured = measured_breakdown(ranks)
    assert measured["per_rank_ms"]["1"][DP_COMM] == pytest.approx(110.0, rel=1e-12)
    assert measured["per_rank_ms"]["1"][PP_BUBBLE] == pytest.approx(0.0, abs=1e-12)
    assert "hosts" in measured["closing_split"]


def test_chimera_replica_exchange_waits_for_its_partner():
    # pp 1 posts its replica gradients at 2.96, its partner (pp 0) at 3.0: 40 ms drain; then the
    # loss sum: posted at 3.055 and 3.06: 5 ms more. Closing 90 + 6 ms; dp_comm 100 ms - 45 ms.
    partner = _rank(0, 0, [("replicas", 3.0, 3.05), ("loss", 3.06, 3.061)], dp_comm_s=0.06)
    drained = _rank(1, 1, [("replicas", 2.96, 3.05), ("loss", 3.055, 3.061)], dp_comm_s=0.1)
    rows = measured_breakdown([partner, drained])["per_rank_ms"]
    assert rows["1"][PP_BUBBLE] == pytest.approx(45.0, rel=1e-9)
    assert rows["1"][DP_COMM] == pytest.approx(55.0, rel=1e-9)
    assert rows["0"][PP_BUBBLE] == pytest.approx(0.0, abs=1e-12)
    assert rows["0"][DP_COMM] == pytest.approx(60.0, rel=1e-12)


def test_a_replica_exchange_without_its_partner_is_refused_by_name():
    # a pipeline whose reports hold pp 0 and pp 2 only: pp 0's Chimera partner (pp 1 of 2 members) is missing
    first = _rank(0, 0, [("replicas", 3.0, 3.05)], dp_comm_s=0.05)
    last = _rank(1, 2, [("replicas", 3.0, 3.05)], dp_comm_s=0.05)
    with pytest.raises(AssertionError, match="Chimera partner 1 is not among the pipeline's members"):
        measured_breakdown([first, last])
