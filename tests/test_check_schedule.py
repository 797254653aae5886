"""check_triton's run phase (benchmarks/_check_schedule.py) keeps the case processes within the
GPU-memory budget: on the H100 a dozen case processes that each reserved GBs of local memory
ran it out of memory. Dummy cases that sleep stand in for the GPU ones; their start and end
times say what ran at once."""

from __future__ import annotations

import multiprocessing
import time

from _scripts import load_script

schedule = load_script("benchmarks/_check_schedule.py")


def _sleep_case(index: int, seconds: float) -> tuple[int, float, float]:
    start = time.monotonic()
    time.sleep(seconds)
    return index, start, time.monotonic()


def _no_init() -> None:
    pass


def _run(memory: list[float], budget: float, workers: int) -> dict[int, tuple[float, float]]:
    spans: dict[int, tuple[float, float]] = {}

    def on_result(result: tuple[int, float, float]) -> None:
        spans[result[0]] = (result[1], result[2])

    schedule.run_phase(
        [(i, 2.0) for i in range(len(memory))],  # what run_phase passes to the task
        memory,
        budget,
        _sleep_case,
        workers,
        multiprocessing.get_context("spawn"),  # as check_triton (no fork: one task per process)
        _no_init,
        (),
        on_result,
    )
    return spans


def _peak(spans: dict[int, tuple[float, float]], memory: list[float]) -> float:
    """The most memory the cases running at one moment held (checked at every start)."""
    return max(
        sum(memory[j] for j, (s, e) in spans.items() if s <= start < e)
        for start, _ in spans.values()
    )


def test_cases_run_within_the_memory_budget_and_all_run() -> None:
    memory = [30.0, 30.0, 5.0, 30.0, 5.0, 5.0]
    spans = _run(memory, budget=50.0, workers=4)
    assert sorted(spans) == list(range(len(memory)))
    assert _peak(spans, memory) <= 50.0
    # not one at a time: a small case fits beside a large one
    assert _peak(spans, memory) >= 35.0


def test_a_case_larger_than_the_budget_runs_alone() -> None:
    memory = [80.0, 5.0, 5.0]
    spans = _run(memory, budget=50.0, workers=3)
    start, end = spans[0]
    assert sorted(spans) == [0, 1, 2]
    assert all(e <= start or s >= end for i, (s, e) in spans.items() if i != 0)


def test_batches_keep_a_group_together_up_to_the_size_in_first_appearance_order():
    cases = ["a1", "b1", "a2", "a3", "c1", "b2", "a4", "a5"]
    groups = schedule.batches(cases, lambda c: c[0], 2)
    assert groups == [[0, 2], [3, 6], [7], [1, 5], [4]]
    assert sorted(i for g in groups for i in g) == list(range(len(cases)))
