"""The span timer behind LLM.start_profile / stop_profile, in one process."""

from __future__ import annotations

import time

import pytest

from mpexec.models import profiling


def test_spans_cost_nothing_and_record_nothing_without_a_profile() -> None:
    with profiling.span("idle"):
        pass
    profiling.start()
    summary = profiling.stop(rank=3)
    assert summary.rank == 3 and summary.spans == {}


def test_spans_add_up_per_name_while_a_profile_runs() -> None:
    profiling.start()
    for _ in range(3):
        with profiling.span("a.sleep"):
            time.sleep(0.01)
    with pytest.raises(ZeroDivisionError), profiling.span("a.raises"):
        1 / 0  # noqa: B018
    summary = profiling.stop(rank=0)
    assert summary.spans["a.sleep"].calls == 3
    assert summary.spans["a.sleep"].seconds >= 0.03
    assert summary.spans["a.raises"].calls == 1
    assert 0 < summary.share("a.") <= 1
    assert summary.share("b.") == 0


def test_start_twice_and_stop_without_start_are_errors() -> None:
    profiling.start()
    with pytest.raises(RuntimeError, match="already running"):
        profiling.start()
    profiling.stop(rank=0)
    with pytest.raises(RuntimeError, match="no profile is running"):
        profiling.stop(rank=0)
