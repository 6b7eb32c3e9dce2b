"""What a rank reports about itself and its peers (``collectives``)."""

from __future__ import annotations

import sys

from rlvr_lightning.runtime import collectives


def test_peers_that_stopped_reporting_are_named_with_their_last_activity():
    beats = {
        1: {"time": 100.0, "step": 3, "doing": "reward (r.py:4)", "host": "a"},
        2: {"time": 139.0, "step": 3, "doing": "update (u.py:9)", "host": "b"},
        3: None,
    }
    text, silent = collectives.describe_peers(beats, stale_s=15.0, now=140.0)
    assert silent == [1, 3]
    assert "rank 1 has not answered for 40 s (last: step 3, in reward (r.py:4) on host a)" in text
    assert "rank 2 is alive (step 3, in update (u.py:9) on host b)" in text
    assert "rank 3 has not reported since the run started" in text


def test_activity_names_the_innermost_project_frames_and_no_collective_is_found():
    def reward_in_progress() -> str:
        return collectives.activity(sys._getframe())

    text = reward_in_progress()
    assert text.startswith("reward_in_progress (test_collectives.py:")
    assert " < test_activity_names_the_innermost_project_frames" in text
    assert collectives.waiting_on(sys._getframe()) is None


def test_the_outermost_collective_frame_is_named_with_its_caller():
    """A stack as torch's ``all_gather_object`` -> ``all_gather`` blocks in, built from code
    compiled under a ``torch/distributed`` file name."""
    source = (
        "def all_gather(look):\n    return look()\n"
        "def all_gather_object(look):\n    return all_gather(look)\n"
    )
    fake: dict = {}
    exec(compile(source, "/site/torch/distributed/distributed_c10d.py", "exec"), fake)

    def caller_in_project():
        return fake["all_gather_object"](lambda: collectives.waiting_on(sys._getframe(1)))

    name, frame = caller_in_project()
    assert name == "all_gather_object"
    assert frame.f_back.f_code.co_name == "caller_in_project"
