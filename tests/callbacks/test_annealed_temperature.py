"""AnnealedTemperature (EAD): the schedule by hand, setup refusals, state round trip."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from rlvr_lightning.callbacks import AnnealedTemperature
from rlvr_lightning.callbacks.annealed_temperature import annealed_temperature

from rlvr_lightning.options import Correction, Options
from rlvr_lightning.rollout import factory
from rlvr_lightning.types import Sampling


def test_schedule_by_hand():
    # Defaults (1.2, 0.1, d0 200, alpha 5, d_max 40000, c 10).
    assert annealed_temperature(0, 0) == 1.0 and annealed_temperature(9, 0) == 1.0  # t < c
    assert annealed_temperature(10, 0) == pytest.approx(2.2 - math.exp(10 / 200))  # 1.148729
    assert annealed_temperature(200, 0) == 0.1  # 2.2 - e = -0.518 -> the floor
    assert annealed_temperature(200, 40) == pytest.approx(2.2 - math.exp(0.5))  # d = 400: 0.551
    # d = min(200 + 5e6, 40000) = 40000: 2.2 - e^0.01 = 1.189950
    assert annealed_temperature(400, 10**6) == pytest.approx(2.2 - math.exp(0.01))
    assert annealed_temperature(0, 0, c=0) == pytest.approx(1.2)  # t = 0 gives tau_max
    # Vectorised: the same values, float32.
    got = annealed_temperature(torch.tensor([0, 9, 10, 200]), 0)
    assert got.dtype == torch.float32
    assert torch.allclose(got, torch.tensor([1.0, 1.0, 2.2 - math.exp(0.05), 0.1]))


def test_schedule_tensor_matches_scalars():
    t = torch.arange(300)
    args = dict(tau_max=1.0, tau_min=0.3, d0=50.0, alpha=2.0, d_max=60.0, c=3)
    got = annealed_temperature(t, 7, **args)
    expected = [annealed_temperature(i, 7, **args) for i in range(300)]
    assert torch.allclose(got, torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize(
    "kwargs", [dict(tau_min=0.0), dict(tau_min=2.0), dict(d0=0.0), dict(d_max=10.0), dict(c=-1)]
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError, match="AnnealedTemperature needs"):
        AnnealedTemperature(**kwargs)


def _module(engine="hf", policy="tiny:0", old_logprobs="auto", temperature=1.0):
    """What ``setup`` reads of an ``RLVRModule``, without building one."""
    return SimpleNamespace(
        hparams=SimpleNamespace(engine=engine, policy=policy),
        options=Options(correction=Correction(old_logprobs=old_logprobs)),
        sampling=Sampling(temperature=temperature),
    )


def test_setup_refuses_vllm_and_names_the_hf_engine(monkeypatch):
    cb = AnnealedTemperature()
    cb.setup(None, _module(), "fit")  # hf: fine
    with pytest.raises(ValueError, match=r"model\.engine: hf"):
        cb.setup(None, _module(engine="vllm"), "fit")
    # `auto` resolves to vLLM for a saved model once vLLM is installed (mocked here).
    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    with pytest.raises(ValueError, match=r"model\.engine: hf"):
        cb.setup(None, _module(engine="auto", policy="embedded:smollm2-135m-instruct"), "fit")
    cb.setup(None, _module(engine="auto"), "fit")  # tiny: models stay on hf


def test_setup_refuses_greedy_and_engine_logprobs():
    with pytest.raises(ValueError, match="temperature > 0"):
        AnnealedTemperature().setup(None, _module(temperature=0.0), "fit")
    with pytest.raises(ValueError, match="old_logprobs: auto"):
        AnnealedTemperature().setup(None, _module(old_logprobs="engine"), "fit")


def test_state_round_trip():
    cb = AnnealedTemperature()
    cb.step = 7
    restored = AnnealedTemperature()
    restored.load_state_dict(cb.state_dict())
    assert restored.step == 7 and cb.state_dict() == {"step": 7}
