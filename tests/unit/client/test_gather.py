"""``_base.gather``: several flows of calls run as one, as the EPD rewrite runs its hand-offs; each
flow gets back exactly the answers to its own calls, a flow that sleeps does not hold up the others,
and each flow's outcome is its value or its exception, in order (pure: a script answers the calls,
a fake clock advances only by the sleeps)."""

from __future__ import annotations

from typing import Any

import pytest
from encode_client._base import Call, Flow, Sleep, gather


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _asks(name: str, rounds: int, sleep: float = 0.0, fail: bool = False) -> Flow[list[Any]]:
    """Asks ``rounds`` times for its own ``name``-d call, sleeping ``sleep`` s between rounds."""
    got: list[Any] = []
    for n in range(rounds):
        if n and sleep:
            yield Sleep(sleep)
        (answer,) = yield [Call("r", "model", f"{name}{n}", (0,))]
        got.append(answer)
    if fail:
        raise ValueError(f"{name} failed")
    return got


def _drive(flow: Flow[Any], clock: Clock) -> tuple[Any, list[list[str]], list[float]]:
    """What ``flow`` gives, the payloads of each step's calls, and each sleep."""
    steps: list[list[str]] = []
    sleeps: list[float] = []
    try:
        step = next(flow)
        while True:
            if isinstance(step, Sleep):
                sleeps.append(step.seconds)
                clock.now += step.seconds
                step = flow.send([])
            else:
                steps.append([call.payload for call in step])
                step = flow.send([f"answer to {call.payload}" for call in step])
    except StopIteration as stop:
        return stop.value, steps, sleeps


def test_each_flow_gets_the_answers_to_its_own_calls_and_the_calls_of_a_step_go_together() -> None:
    clock = Clock()
    outcomes, steps, sleeps = _drive(gather([_asks("a", 2), _asks("b", 1), _asks("c", 3)], clock), clock)
    assert outcomes == [["answer to a0", "answer to a1"], ["answer to b0"],
                        ["answer to c0", "answer to c1", "answer to c2"]]
    assert steps == [["a0", "b0", "c0"], ["a1", "c1"], ["c2"]] and sleeps == []


def test_a_sleeping_flow_waits_out_its_own_time_while_the_others_go_on() -> None:
    clock = Clock()
    outcomes, steps, sleeps = _drive(gather([_asks("slow", 2, sleep=1.0), _asks("busy", 3)], clock), clock)
    assert steps == [["slow0", "busy0"], ["busy1"], ["busy2"], ["slow1"]]
    assert sleeps == [pytest.approx(1.0)]  # the others' calls took no time on this clock
    assert outcomes[0] == ["answer to slow0", "answer to slow1"]


def test_an_exception_is_its_flows_outcome_and_the_others_still_finish() -> None:
    clock = Clock()
    outcomes, _, _ = _drive(gather([_asks("a", 1, fail=True), _asks("b", 2)], clock), clock)
    assert isinstance(outcomes[0], ValueError) and str(outcomes[0]) == "a failed"
    assert outcomes[1] == ["answer to b0", "answer to b1"]


def test_no_flows_is_no_step() -> None:
    clock = Clock()
    assert _drive(gather([], clock), clock) == ([], [], [])
