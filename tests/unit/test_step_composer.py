"""``StepComposer`` without a data module: fresh steps, resume from its state, misuse."""

from __future__ import annotations

import pytest

from rlvr_lightning.data.composition import StepComposer
from rlvr_lightning.data.sources import Example

EXAMPLES = [Example(f"t:{i}", f"q{i}", {"answer": str(i)}) for i in range(10)]


def _ids(examples: list[Example]) -> list[str]:
    return [e.prompt_id for e in examples]


def test_a_step_takes_distinct_fresh_prompts_and_a_restored_state_repeats_the_next_one():
    composer = StepComposer(None, None, stats_history=4, seed=3)
    composer.start(EXAMPLES)
    first = composer.compose(4)
    assert len(set(_ids(first))) == 4
    saved = composer.state_dict()
    second = composer.compose(4)
    # no prompt repeats within an epoch of 10: the second step draws 4 others
    assert not set(_ids(first)) & set(_ids(second))
    resumed = StepComposer(None, None, stats_history=4, seed=3)
    resumed.start(EXAMPLES)
    resumed.load_state_dict(saved)
    assert _ids(resumed.compose(4)) == _ids(second)


def test_draw_excludes_the_given_prompts():
    composer = StepComposer(None, None, stats_history=4, seed=0)
    composer.start(EXAMPLES)
    drawn = composer.draw(9, exclude=["t:0"])
    assert "t:0" not in _ids(drawn) and len(set(_ids(drawn))) == 9


def test_composing_before_start_says_what_to_call():
    with pytest.raises(RuntimeError, match=r"start\(examples\) must run before"):
        StepComposer(None, None, stats_history=4, seed=0).compose(2)


def test_a_state_from_another_seed_is_refused_with_the_fix():
    composer = StepComposer(None, None, stats_history=4, seed=0)
    state = StepComposer(None, None, stats_history=4, seed=1).state_dict()
    with pytest.raises(ValueError, match="set seed: 1 to resume"):
        composer.load_state_dict(state)


class _StubReplay:
    """Serves one given prompt per step as a replay; records what is released."""

    def __init__(self, serve: list[str]) -> None:
        self.serve, self.released, self.observed = list(serve), [], []

    def budget(self, total: int) -> int:
        return 1

    def select(self, step: int, budget: int, reserved: object) -> list[str]:
        return [self.serve.pop(0)]

    def observe(self, step: int, observed: list) -> None:
        self.observed += [(o.prompt_id, o.replayed) for o in observed]

    def release(self, prompt_ids: set[str]) -> None:
        self.released += sorted(prompt_ids)


def _output(ids: list[str]):
    import torch

    from rlvr_lightning.types import StepOutput

    b, g = len(ids), 2
    ones = torch.ones(b, g)
    return StepOutput(0, ids, g, ones, ones.bool(), ones, torch.ones(b), torch.zeros(b))


def test_a_held_step_reports_its_own_replays_later_and_releases_none_in_flight():
    """Asynchronous rollouts: step A is reported after step B was composed. A's replay is
    observed as a replay, and B's, still queued, is not released as "never observed"."""
    replay = _StubReplay(["t:5", "t:6"])
    composer = StepComposer(replay, None, stats_history=4, seed=0)
    composer.start(EXAMPLES)
    a = _ids(composer.compose(2))
    served_a = composer.hold_step()
    assert served_a == ["t:5"] and composer.pending is None  # consumed: saved as taken
    composer.compose(2)
    served_b = composer.hold_step()
    composer.resume_step(served_a)
    composer.observe(_output(a))
    assert replay.released == []
    assert ("t:5", True) in replay.observed
    assert served_b == ["t:6"] and composer.steps == 1
