"""``device.prepare_model``: the one seam for the CPU fast paths."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.device import completion_logprobs, prepare_model
from rlvr_lightning.testing import tiny_policy


def _rows(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 200, (4, 6), generator=gen)  # [n, P]
    pmask = torch.ones_like(prompt)
    pmask[0, :2] = 0  # a left-padded prompt
    completion = torch.randint(3, 200, (4, 5), generator=gen)  # [n, T]
    cmask = torch.ones_like(completion)
    cmask[1, 3:] = 0  # a short completion
    return prompt, pmask, completion, cmask, torch.ones(4)


def _fast_paths(model: torch.nn.Module) -> list[str]:
    """Names of the modules whose forward a fast path replaced, and the attention choice."""
    names = [n for n, m in model.named_modules() if "forward" in vars(m)]
    return [*names, model.config._attn_implementation]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_log_probs_agree_with_and_without_the_fast_paths(dtype, tol):
    plain, _ = tiny_policy(seed=3)
    fast, _ = tiny_policy(seed=3)
    prepare_model(fast, "cpu")
    assert len(_fast_paths(fast)) > 1 and len(_fast_paths(plain)) == 1
    rows = _rows()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        want, _ = completion_logprobs(plain, *rows)  # [n, T]
        got, _ = completion_logprobs(fast, *rows)
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=0)
    assert bool((got[1, 3:] == 0).all())


def test_another_device_gets_the_model_as_transformers_built_it():
    model, _ = tiny_policy(seed=1)
    built = _fast_paths(model)
    prepare_model(model, "cpu")
    assert _fast_paths(model) != built
    prepare_model(model, "cuda")  # only marks and restores: nothing runs on the device
    assert _fast_paths(model) == built
    rows = _rows(1)
    with torch.no_grad():
        again, _ = completion_logprobs(model, *rows)
        reference, _ = completion_logprobs(tiny_policy(seed=1)[0], *rows)
    assert torch.equal(again, reference)


def test_preparing_twice_changes_nothing():
    model, _ = tiny_policy(seed=2)
    prepare_model(model, "cpu")
    once = _fast_paths(model)
    prepare_model(model, "cpu")
    assert _fast_paths(model) == once
