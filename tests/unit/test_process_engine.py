"""The rollout worker process (``rollout.process.ProcessEngine``) around the HF engine on its
own policy copy (``rollout.hf_copy``): requests in order, seeds drawn by the caller, weights
through shared memory, the child's errors and death surfaced, and a clean stop."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.asynchrony.fingerprint import module_sums
from rlvr_lightning.rollout.base import policy_weights
from rlvr_lightning.rollout.factory import build_engine, build_hf_copy
from rlvr_lightning.rollout.process import ProcessEngine
from rlvr_lightning.testing import tiny_policy
from rlvr_lightning.types import Sampling

SAMPLING = Sampling(max_new_tokens=6, temperature=1.0, group_size=2)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model, tokenizer = tiny_policy(seed=0)
    tokenizer.padding_side = "left"
    folder = tmp_path_factory.mktemp("policy")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer, str(folder)


@pytest.fixture(scope="module")
def worker(policy):
    model, tokenizer, folder = policy
    engine = build_engine("hf", folder, model, tokenizer, "float32", {"process": True})
    assert isinstance(engine, ProcessEngine) and not engine.shares_policy
    yield engine
    engine.close()


def _prompts(tokenizer):
    enc = tokenizer(["1+2=", "a longer one"], return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def test_requests_answer_in_order_and_the_seeds_come_from_the_caller(policy, worker):
    ids, mask = _prompts(policy[1])
    torch.manual_seed(0)
    first, second = worker.submit(ids, mask, SAMPLING), worker.submit(ids, mask, SAMPLING)
    after = torch.randint(0, 10**6, (1,))
    b, a = worker.collect(second), worker.collect(first)  # the later one first: both kept
    torch.manual_seed(0)
    again = worker.generate(ids, mask, SAMPLING)
    assert torch.equal(a.completion_ids, again.completion_ids)
    assert a.completion_ids.shape[0] == 4 and b.completion_ids.shape[0] == 4
    # Two requests drew 2 x 4 seeds here, and nothing else: the caller's stream is its own.
    torch.manual_seed(0)
    torch.randint(0, 2**31 - 1, (4,)), torch.randint(0, 2**31 - 1, (4,))
    assert torch.equal(after, torch.randint(0, 10**6, (1,)))
    assert worker.take_busy() > 0 and worker.take_busy() == 0


def test_weights_go_through_shared_memory_and_are_read_back(policy, worker):
    model, _, _ = policy
    with policy_weights(model) as named:
        worker.load_weights(named)
    buffers = worker._buffers
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    with policy_weights(model) as named:
        worker.load_weights(named)
    assert worker._buffers is buffers  # made once, reused
    held = worker.read_weights(module_sums)
    with policy_weights(model) as named:
        expected = module_sums(named, torch.float32)
    assert held.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.allclose(torch.as_tensor(held[key]), torch.as_tensor(value)), key


def test_an_error_in_the_worker_is_raised_here_and_the_worker_goes_on(policy, worker):
    with pytest.raises(RuntimeError, match="has no weight 'nonsense'"):
        worker._call("load_weights", [("nonsense", torch.zeros(1))])
    ids, mask = _prompts(policy[1])
    assert worker.generate(ids, mask, SAMPLING).completion_ids.shape[0] == 4


def test_a_dead_worker_is_named_and_a_closed_one_is_gone(policy):
    _, tokenizer, folder = policy
    engine = ProcessEngine(build_hf_copy, (folder, tokenizer), {}, tokenizer)
    engine._process.kill()
    engine._process.join()
    ids, mask = _prompts(tokenizer)
    with pytest.raises(RuntimeError, match="worker process died"):
        engine.generate(ids, mask, SAMPLING)
    engine.close()  # a no-op on a dead worker
    other = ProcessEngine(build_hf_copy, (folder, tokenizer), {}, tokenizer)
    other.close()
    assert other._process.exitcode == 0


def test_a_worker_that_cannot_build_its_engine_says_why(policy, tmp_path):
    _, tokenizer, _ = policy
    with pytest.raises(RuntimeError, match="does not exist"):
        ProcessEngine(build_hf_copy, (str(tmp_path / "missing"), tokenizer), {}, tokenizer)


def test_a_dropped_engine_stops_its_worker(policy):
    import gc

    _, tokenizer, folder = policy
    engine = ProcessEngine(build_hf_copy, (folder, tokenizer), {}, tokenizer)
    process = engine._process
    del engine
    gc.collect()
    process.join(15)
    assert process.exitcode == 0
