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
