"""Fixtures shared by the test folders (not a root conftest: nothing here touches sys.path).

``fake_hub`` gives the ``FakeHub`` class of ``tests/hub_server.py``, a loopback stand-in for the
Hub; the tests import no helper modules directly, since ``--import-mode=importlib`` leaves the
tests folder off ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_HUB_SERVER = "rlvr_lightning_tests_hub_server"


def _hub_server() -> ModuleType:
    if _HUB_SERVER not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            _HUB_SERVER, Path(__file__).with_name("hub_server.py")
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[_HUB_SERVER] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[_HUB_SERVER]


@pytest.fixture
def fake_hub() -> type:
    """The ``FakeHub`` class: ``with fake_hub() as hub:`` serves it at ``hub.url``."""
    return _hub_server().FakeHub


@pytest.fixture
def fit_error(capsys):
    """``fit_error(*args)``: run ``rlvr-lightning fit --config configs/tiny.yaml *args``,
    expect a parse error (exit 2) and return its report: a few lines from the command's own
    line on, without a traceback."""
    from rlvr_lightning.cli.main import main

    config = str(Path(__file__).parents[1] / "configs" / "tiny.yaml")

    def run(*args: str) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", config, *args])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        err = err[err.index("rlvr-lightning") :].strip()
        assert "Traceback" not in err and len(err.splitlines()) < 6, err
        return err

    return run


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny model's byte tokenizer (``models.tiny``), with its chat template."""
    from rlvr_lightning.testing import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture
def uneven_lengths(monkeypatch):
    """The tiny random model never samples EOS: here every row of a prompt whose first 30
    context bytes sum to an even number ends at the third token of a chunk (EOS written over
    it), the others run to ``max_new_tokens``, so groups finish at different chunks and the
    long ones continue into the next step (partial rollouts). Deterministic, so resumes can
    compare."""
    from rlvr_lightning.rollout.hf import HFEngine

    generate = HFEngine.generate

    def uneven(self, ids, mask, sampling, *args, **kwargs):
        r = generate(self, ids, mask, sampling, *args, **kwargs)
        for j in range(r.num_rows):
            i = j // r.group_size
            # A short prompt's rows end in their first chunk (4 tokens): never continued.
            if r.completion_ids.shape[1] > 2 and int(ids[i][mask[i].bool()][:30].sum()) % 2 == 0:
                r.completion_ids[j, 2] = self.tokenizer.eos_token_id
                r.completion_mask[j, 3:] = 0
                r.behaviour_logp[j, 3:] = 0
                r.truncated[j] = False
        return r

    monkeypatch.setattr(HFEngine, "generate", uneven)
