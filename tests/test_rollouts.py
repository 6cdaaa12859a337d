"""The one rollouts interface (rollouts.py): both schedules have its methods with its signatures, and the staleness
rule is one predicate with its reason. (That the async schedule at staleness 0 reproduces the sync run exactly is
test_async.py's; the engines' numerics are test_engine.py's.)"""
import inspect
from types import SimpleNamespace

import pytest

from opd.training.async_rollouts import AsyncRollouts
from opd.engines.builtin import Engine
from opd.training.rollouts import Rollouts, SyncRollouts, too_stale
from opd.engines.vllm import VllmEngine


SCHEDULES = {"sync": lambda: SyncRollouts(lambda plan: SimpleNamespace(scales={}), None, None, None, 0, False),
             "async": lambda: AsyncRollouts(None, None, 0, 0, 0, "requeue", 1.0, 0)}  # built, not started


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_both_schedules_have_the_interfaces_methods(schedule):
    rollouts = SCHEDULES[schedule]()
    for name in ("start", "next_batch", "publish", "set_plan", "state_dict", "close"):
        want = inspect.signature(getattr(Rollouts, name))
        got = inspect.signature(getattr(rollouts, name))
        assert list(got.parameters) == list(want.parameters)[1:], (schedule, name)  # bound: no self
    assert isinstance(rollouts.scales, dict) and isinstance(rollouts.counts, dict)


def test_both_engines_declare_what_they_return_and_close():
    """The probe and `opd generate` ask the engine (`hidden_states`), not its type."""
    assert Engine.hidden_states and not VllmEngine.hidden_states
    for engine in (Engine, VllmEngine):
        assert callable(engine.close) and "stats" in inspect.signature(engine.generate).parameters


@pytest.mark.parametrize("sampled,learner,limit,ok", [(5, 5, 0, True), (4, 5, 0, False), (3, 5, 2, True),
                                                     (2, 5, 2, False), (7, 5, 0, True)])
def test_too_stale_is_the_one_staleness_rule_and_says_why(sampled, learner, limit, ok):
    reason = too_stale(sampled, learner, limit)
    assert (reason is None) == ok
    if not ok:
        assert f"{learner - sampled} steps behind" in reason and f"max_staleness {limit}" in reason
