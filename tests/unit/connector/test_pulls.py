"""Prefill's record of its pulls: totals, and the bound on pulls that never finish (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvbridge_connector import pulls
from kvbridge_connector.pulls import PullReporter


def test_a_finished_pull_counts_once_and_a_repeated_start_is_ignored() -> None:
    reporter = PullReporter(bytes_per_token=10)
    reporter.start("r1", 96, "d0", blocks=3)
    reporter.start("r1", 1, "d1")  # vLLM may schedule the same pull again: the first start stands
    done = reporter.finish("r1", failed=False)
    assert done is not None and (done.source_engine, done.tokens, done.bytes) == ("d0", 96, 960)
    assert reporter.finish("r1", failed=False) is None  # already finished
    assert (reporter.succeeded, reporter.failed, reporter.tokens_pulled, reporter.bytes_pulled) == (1, 0, 96, 960)


def test_pulls_that_never_finish_are_forgotten_oldest_first_past_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pulls, "_MAX_IN_FLIGHT", 2)
    reporter = PullReporter(bytes_per_token=1)
    for request_id in ("aborted", "r2", "r3"):
        reporter.start(request_id, 32, "d0")
    assert reporter.finish("aborted", failed=False) is None  # the oldest, dropped for the newest
    assert reporter.finish("r2", failed=True) is not None and reporter.finish("r3", failed=False) is not None
    assert (reporter.succeeded, reporter.failed) == (1, 1)
