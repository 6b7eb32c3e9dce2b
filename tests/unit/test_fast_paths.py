"""``device.fast_paths``: the fast paths chosen by (mock) timings on a model's shapes, values
checked against the reference path, the per-machine cache, and the switch that turns it off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlvr_lightning.device import (
    attention,
    cpu_linear,
    fast_path_choices,
    fast_paths,
    measured_precision,
    precision_choice,
    prepare_model,
)
from rlvr_lightning.testing import tiny_policy

SHAPES = fast_paths.ModelShapes(linears=((8, 4, 2),), heads=4, kv_heads=2, head_dim=8)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """An empty cache folder and no decisions made; the process's own decisions come back."""
    monkeypatch.setenv(fast_paths.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(fast_paths.ENV, raising=False)
    monkeypatch.setattr(fast_paths.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine
    made, state = dict(fast_paths._made), dict(fast_paths._state)
    fast_paths.reset()
    yield tmp_path
    fast_paths.reset()
    fast_paths._made.update(made)
    fast_paths._state.update(state)


def _mock_times(monkeypatch, times: dict[str, float]) -> list[str]:
    """Every timed run of candidate ``name`` takes ``times[name]`` seconds; returns the calls."""
    calls: list[str] = []

    def timer(work, name):
        calls.append(name)
        return times[name]

    monkeypatch.setattr(fast_paths, "timer", timer)
    return calls


def _toy_path(monkeypatch, outputs: dict[str, float]) -> list[int]:
    """Path ``"toy"``: candidates whose work returns ``outputs[name] * ones``, reference
    ``"ref"``. Returns a list that grows by one each time the path is measured."""
    measured: list[int] = []

    def measurer(shapes, dtype):
        measured.append(1)
        works = {name: (lambda v=v: (torch.full((3,), v),)) for name, v in outputs.items()}
        return fast_paths.Trial(tolerance=1e-3, pieces=[(2.0, works)])

    monkeypatch.setitem(fast_paths._registry, "toy", ("ref", measurer))
    fast_paths.use_shapes(SHAPES)
    return measured


def test_select_keeps_the_reference_unless_a_correct_candidate_is_faster():
    seconds = {"ref": 1.0, "fast_wrong": 0.2, "fast": 0.5, "faster": 0.4, "tie": 0.97}
    errors = {"ref": 0.0, "fast_wrong": 0.5, "fast": 1e-6, "faster": 1e-6, "tie": 0.0}
    assert fast_paths.select("ref", seconds, errors, 1e-4) == "faster"
    del seconds["faster"], seconds["fast"]
    # 0.2 s but values off by half; 0.97 s is within MIN_GAIN (5 %) of the reference's 1 s.
    assert fast_paths.select("ref", seconds, errors, 1e-4) == "ref"
    nan = {**errors, "fast_wrong": float("nan")}
    assert fast_paths.select("ref", seconds, nan, 1e-4) == "ref"


def test_a_wrong_candidate_is_not_chosen_however_fast(monkeypatch):
    _toy_path(monkeypatch, {"ref": 1.0, "wrong": 1.5, "right": 1.0})
    _mock_times(monkeypatch, {"ref": 0.010, "wrong": 0.001, "right": 0.008})
    assert fast_paths.choice("toy", torch.float32) == "right"
    made = fast_paths.chosen()["toy/float32"]
    assert made.errors["wrong"] == pytest.approx(0.5)  # |1.5 - 1| / 1
    # Weighted by the piece's weight 2: each candidate's best time counts twice.
    assert made.seconds == pytest.approx({"ref": 0.020, "wrong": 0.002, "right": 0.016})


def test_a_slower_candidate_leaves_the_reference(monkeypatch):
    _toy_path(monkeypatch, {"ref": 1.0, "slow": 1.0})
    calls = _mock_times(monkeypatch, {"ref": 0.010, "slow": 0.011})
    assert fast_paths.choice("toy", torch.float32) == "ref"
    # Mock runs of 10-11 ms: REPS (2) runs each give every candidate its PIECE_SECONDS (10 ms).
    assert calls.count("ref") == calls.count("slow") == 2
    assert fast_paths.choice("toy", torch.float32) == "ref"  # decided once per process
    assert len(calls) == 4


def test_the_cache_is_read_back_and_measured_again_when_the_key_changes(monkeypatch, fresh):
    measured = _toy_path(monkeypatch, {"ref": 1.0, "fast": 1.0})
    _mock_times(monkeypatch, {"ref": 0.030, "fast": 0.010})
    assert fast_paths.choice("toy", torch.bfloat16) == "fast" and measured == [1]
    stored = json.loads((Path(fresh) / fast_paths.CACHE_FILE).read_text())
    (key,) = stored
    assert json.loads(key)["path"] == "toy/bfloat16" and stored[key]["choice"] == "fast"

    fast_paths._made.clear()  # a new process on the same machine: read, not measured
    _mock_times(monkeypatch, {"ref": 0.010, "fast": 0.030})
    assert fast_paths.choice("toy", torch.bfloat16) == "fast" and measured == [1]
    assert fast_paths.chosen()["toy/bfloat16"].source == "cached"

    fast_paths._made.clear()  # another torch build: another key, measured again
    machine = {**fast_paths.machine(), "torch": "9.9.9"}
    monkeypatch.setattr(fast_paths, "machine", lambda: machine)
    assert fast_paths.choice("toy", torch.bfloat16) == "ref" and measured == [1, 1]
    assert len(json.loads((Path(fresh) / fast_paths.CACHE_FILE).read_text())) == 2

    fast_paths._made.clear()  # other shapes: measured again
    fast_paths.use_shapes(fast_paths.ModelShapes(linears=(), heads=2, kv_heads=1, head_dim=4))
    fast_paths.choice("toy", torch.bfloat16)
    assert measured == [1, 1, 1]


def test_unsteady_timings_are_used_but_not_cached(monkeypatch, fresh):
    _toy_path(monkeypatch, {"ref": 1.0, "fast": 1.0})
    stalls = iter([0.030, 0.010, 0.010, 0.300] * 10)  # the reference's second run stalls 10x
    monkeypatch.setattr(fast_paths, "timer", lambda work, name: next(stalls))
    assert fast_paths.choice("toy", torch.float32) == "fast"  # best 10 ms against 30 ms
    assert "unsteady: not cached" in fast_paths.chosen()["toy/float32"].source
    assert not (Path(fresh) / fast_paths.CACHE_FILE).exists()
    assert fast_paths.summary() == "toy/float32 fast (measured, unsteady)"


def test_a_measurement_on_a_busy_machine_is_used_but_not_cached(monkeypatch, fresh):
    """Other processes on the cores change which candidate wins (bf16 came out slower than fp32
    so, issue 40): the run uses what it measured, the next one measures again."""
    _toy_path(monkeypatch, {"ref": 1.0, "fast": 1.0})
    _mock_times(monkeypatch, {"ref": 0.030, "fast": 0.010})
    cores = fast_paths.os.cpu_count()
    monkeypatch.setattr(fast_paths.os, "getloadavg", lambda: (cores + 1.0, 0.0, 0.0))
    assert fast_paths.choice("toy", torch.float32) == "fast"
    source = fast_paths.chosen()["toy/float32"].source
    assert f"busy machine (load average {cores + 1:.1f} on {cores} cores): not cached" in source
    assert not (Path(fresh) / fast_paths.CACHE_FILE).exists()
    assert fast_paths.summary() == "toy/float32 fast (measured, busy)"
    fast_paths._made.clear()  # quiet again: measured and cached
    monkeypatch.setattr(fast_paths.os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    assert fast_paths.choice("toy", torch.float32) == "fast"
    assert (Path(fresh) / fast_paths.CACHE_FILE).exists()


def test_a_candidate_that_raises_leaves_the_reference(monkeypatch, fresh):
    def broken(shapes, dtype):
        raise RuntimeError("no such kernel on this CPU")

    monkeypatch.setitem(fast_paths._registry, "toy", ("ref", broken))
    fast_paths.use_shapes(SHAPES)
    assert fast_paths.choice("toy", torch.float32) == "ref"
    assert "no such kernel" in fast_paths.chosen()["toy/float32"].source
    assert not (Path(fresh) / fast_paths.CACHE_FILE).exists()


def test_an_unreadable_cache_is_measured_again(monkeypatch, fresh):
    (Path(fresh) / fast_paths.CACHE_FILE).write_text("{not json")
    measured = _toy_path(monkeypatch, {"ref": 1.0})
    _mock_times(monkeypatch, {"ref": 0.030})
    assert fast_paths.choice("toy", torch.float32) == "ref" and measured == [1]


@pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN linear kernel")
@pytest.mark.parametrize(("onednn_s", "expected"), [(0.5e-3, "onednn"), (2e-3, "torch")])
def test_the_linear_route_follows_the_timings_of_its_real_products(monkeypatch, onednn_s, expected):
    model, _ = tiny_policy(seed=0)
    prepare_model(model, "cpu")
    _mock_times(monkeypatch, {"torch": 1e-3, "onednn": onednn_s})
    x, w = torch.randn(5, 32), torch.randn(16, 32)
    assert cpu_linear.usable(x, w) == (expected == "onednn")
    made = fast_paths.chosen()["linear/float32"]
    assert made.choice == expected and made.errors["onednn"] < 1e-5  # the real products agree
    assert fast_path_choices() == {"linear/float32": expected}


def test_attention_keeps_sdpa_when_the_matmuls_give_other_values(monkeypatch):
    model, _ = tiny_policy(seed=0)
    prepare_model(model, "cpu")
    _mock_times(monkeypatch, {"sdpa": 1e-3, "grouped": 1e-4})  # the matmuls 10x faster
    assert fast_paths.choice(attention.PATH, torch.float32) == "grouped"
    real = attention._grouped
    monkeypatch.setattr(attention, "_grouped", lambda *a: (real(*a)[0] * 1.01, None))
    assert fast_paths.choice(attention.DECODE_PATH, torch.float32) == "sdpa"
    assert fast_paths.chosen()["attention.decode/float32"].errors["grouped"] > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_measured_when_first_asked_in_inference_mode(monkeypatch, dtype):
    """The first validation asks inside ``torch.inference_mode``: the forward-and-backward
    trial must still run (it failed there and kept SDPA on every fresh machine)."""
    model, _ = tiny_policy(seed=0)
    prepare_model(model, "cpu")
    _mock_times(monkeypatch, {"sdpa": 1e-3, "grouped": 1e-4})
    with torch.inference_mode():
        assert fast_paths.choice(attention.PATH, dtype) == "grouped"
    made = fast_paths.chosen()[f"attention/{str(dtype).removeprefix('torch.')}"]
    assert made.source.startswith("measured") and made.errors["grouped"] < 3e-2


def test_reference_mode_installs_no_route_and_measures_nothing(monkeypatch):
    monkeypatch.setenv(fast_paths.ENV, "reference")
    calls = _mock_times(monkeypatch, {})
    model, _ = tiny_policy(seed=0)
    prepare_model(model, "cpu")
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in model.modules() if type(m) is torch.nn.Linear)
    assert not cpu_linear.usable(torch.randn(2, 4), torch.randn(3, 4))
    assert (
        calls == [] and fast_paths.summary() == "linear/float32 torch (RLVR_FAST_PATHS=reference)"
    )


def test_an_unknown_mode_is_refused_with_the_fix(monkeypatch, capsys):
    from rlvr_lightning.cli.main import main

    monkeypatch.setenv(fast_paths.ENV, "fastest")
    config = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", config, "--trainer.max_steps=1"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "RLVR_FAST_PATHS='fastest'" in err and "RLVR_FAST_PATHS=reference" in err


def test_the_model_card_hardware_line_names_the_choices(monkeypatch):
    from types import SimpleNamespace

    from rlvr_lightning.hub.card_lines import hardware_line

    _toy_path(monkeypatch, {"ref": 1.0, "fast": 1.0})
    _mock_times(monkeypatch, {"ref": 0.030, "fast": 0.010})
    fast_paths.choice("toy", torch.float32)
    strategy = SimpleNamespace(root_device=torch.device("cpu"))
    trainer = SimpleNamespace(strategy=strategy, num_devices=1, num_nodes=1, precision="32-true")
    line = hardware_line(trainer)
    assert line.endswith("precision 32-true, fast paths: toy/float32 fast (measured)"), line


@pytest.mark.parametrize(
    ("bf16_s", "expected"), [(0.4e-3, precision_choice.BF16), (0.99e-3, precision_choice.REFERENCE)]
)
def test_precision_follows_the_timings_of_its_real_products(monkeypatch, bf16_s, expected):
    model, _ = tiny_policy(seed=0)
    _mock_times(monkeypatch, {"32-true": 1e-3, "bf16-mixed": bf16_s, "torch": 1e-3, "onednn": 1})
    assert measured_precision(model) == expected
    made = fast_paths.chosen()["precision/float32"]
    assert made.reference == "32-true"
    assert 0 < made.errors["bf16-mixed"] < precision_choice.TOLERANCE  # rounded, and agrees


def test_a_bf16_product_that_disagrees_keeps_fp32_however_fast(monkeypatch):
    model, _ = tiny_policy(seed=0)
    _mock_times(monkeypatch, {"32-true": 1.0, "bf16-mixed": 1e-6, "torch": 1.0, "onednn": 2.0})
    wrong = precision_choice._bf16_products
    monkeypatch.setattr(
        precision_choice, "_bf16_products", lambda *a: tuple(t * 1.1 for t in wrong(*a))
    )
    assert measured_precision(model) == "32-true"


def test_reference_mode_keeps_fp32(monkeypatch):
    monkeypatch.setenv(fast_paths.ENV, "reference")
    model, _ = tiny_policy(seed=0)
    assert measured_precision(model) == "32-true"
