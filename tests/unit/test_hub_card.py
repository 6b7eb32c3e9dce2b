"""Model cards: metadata the Hub parses, the recipe, templates, and no secrets or local paths."""

import importlib.resources
import tomllib
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from rlvr_lightning.hub import model_card
from rlvr_lightning.hub.model_card import RunFacts, TrainingRecord

ROOT = Path(__file__).parents[2]
FAKE_TOKEN = "hf_" + "Zq3" * 10


def _facts(tmp_path: Path, **overrides) -> RunFacts:
    hparams = {
        "policy": "embedded:smollm2-135m-instruct",
        "algorithm": "dapo",
        "loss": {"clip_high": None},
        "lora": {"rank": 0},
        "update": {"lr": 2e-5},
        "_class_path": "rlvr_lightning.RLVRModule",
    }
    facts = RunFacts(
        hparams=hparams,
        data_hparams={"source": "addition", "val_size": 50, "prompts_per_step": 8},
        rewards=[
            {"name": "boxed_accuracy", "weight": 1.0},
            {"name": "boxed_format", "weight": 0.25},
        ],
        accuracy_reward="boxed_accuracy",
        callbacks=[{"name": "ExportModel", "settings": {"dirpath": "model"}}],
        steps=20,
        hardware="1 x CPU (x86_64, 2 cores), precision bf16-mixed",
    )
    for key, value in overrides.items():
        setattr(facts, key, value)
    return facts


def _record() -> TrainingRecord:
    record = TrainingRecord(wall_time_s=742.0)
    record.add_validation(0, {"val/accuracy": 0.0, "val/reward": 0.145})
    for step, reward in enumerate([0.2, 0.5, 0.9]):
        record.add_step(step, reward, reward / 2, tokens=100)
    record.add_validation(3, {"val/accuracy": 0.84, "val/reward": 1.3})
    return record


def test_before_after_picks_step_zero_and_the_last_later_validation():
    record = TrainingRecord()
    assert record.before_after() == (None, None)
    record.add_validation(0, {"a": 1.0})
    record.add_validation(2, {"a": 2.0})
    record.add_validation(4, {"a": 3.0})
    assert record.before_after() == ({"a": 1.0}, {"a": 3.0})


def test_card_metadata_parses_back_with_huggingface_hub(tmp_path):
    context = model_card.card_context(_facts(tmp_path), _record(), repo_id="me/adder")
    card = ModelCard(model_card.render_card(context))
    data = card.data
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data.library_name == "transformers"
    assert data.license == "apache-2.0"
    assert data.pipeline_tag == "text-generation"
    assert {"rlvr", "dapo"} <= set(data.tags)
    assert data.model_name == "adder"
    results = {r.metric_name: r.metric_value for r in data.eval_results}
    assert results == {"val/accuracy": 0.84, "val/reward": 1.3}  # after training
    assert {r.dataset_type for r in data.eval_results} == {"addition"}


def test_card_body_has_recipe_results_curve_usage_and_citations(tmp_path):
    context = model_card.card_context(
        _facts(tmp_path), _record(), repo_id="me/adder", reward_curve="reward_curve.png"
    )
    text = model_card.render_card(context)
    # dapo preset: clip_high 0.28, token-mean aggregation (presets.py).
    assert "clip high 0.28" in text and "`token-mean`" in text
    assert "| val/accuracy | 0.0000 | 0.8400 |" in text
    assert "| generated tokens | 300 |" in text
    assert "12 min 22 s" in text
    assert '`boxed_accuracy` (defines "correct") | 1.0 |' in text
    assert "![Training reward per step](reward_curve.png)" in text
    assert 'AutoModelForCausalLM.from_pretrained("me/adder")' in text
    assert "arXiv:2503.14476" in text  # DAPO
    assert "_class_path" not in text


def test_hub_dataset_sources_are_listed_as_datasets(tmp_path):
    facts = _facts(tmp_path, data_hparams={"source": "openai/gsm8k"})
    card = ModelCard(model_card.render_card(model_card.card_context(facts, _record())))
    assert card.data.datasets == ["openai/gsm8k"]


def test_card_never_contains_tokens_or_local_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    local = tmp_path / "data" / "train.jsonl"
    facts = _facts(
        tmp_path,
        data_hparams={"source": str(local), "note": f"token {FAKE_TOKEN} in {Path.home()}/x/y"},
        callbacks=[{"name": "PushToHub", "settings": {"dirpath": str(tmp_path / "model")}}],
    )
    facts.hparams["policy"] = str(tmp_path / "my-model")
    facts.hparams["rewards"] = {"functions": [f"{tmp_path}/rewards.py:fn"]}
    text = model_card.render_card(model_card.card_context(facts, _record()))
    assert FAKE_TOKEN not in text and "hf_Zq3" not in text
    assert str(tmp_path) not in text and str(Path.home()) not in text
    assert model_card.LOCAL_PATH in text
    assert "base_model" not in text.split("---")[1]  # a local policy has no public base


def test_scrub_keeps_urls_and_relative_paths():
    text = (
        "see https://huggingface.co/org/name/blob/main/x.py and configs/quickstart.yaml, "
        "saved in /home/someone/runs/a and C:\\Users\\me\\model, key hf_abcdefghijklmnopqrstu"
    )
    out = model_card.scrub(text)
    assert "https://huggingface.co/org/name/blob/main/x.py" in out
    assert "configs/quickstart.yaml" in out
    assert "/home/someone" not in out and "Users" not in out
    assert "hf_abcdefghijklmnopqrstu" not in out and model_card.REDACTED in out


def test_template_by_name_or_path_and_a_clear_error(tmp_path):
    assert "default" in model_card.available_templates()
    own = tmp_path / "mine.md.j2"
    own.write_text("---\n{{ metadata }}\n---\n# {{ model_name }} by {{ recipe.algorithm }}\n")
    context = model_card.card_context(_facts(tmp_path), _record(), repo_id="me/adder")
    assert model_card.render_card(context, str(own)).rstrip().endswith("# adder by dapo")
    with pytest.raises(FileNotFoundError, match="default"):
        model_card.render_card(context, "no-such-template")


def test_template_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["rlvr_lightning.hub_cards"]
    shipped = [p.name for p in (ROOT / "hub_cards").iterdir() if ".md." in p.name]
    assert shipped and all(any(Path(n).match(p) for p in patterns) for n in shipped)
    installed = importlib.resources.files("rlvr_lightning.hub_cards") / "default.md.jinja"
    assert installed.is_file()


def test_reward_curve_is_a_png(tmp_path):
    path = model_card.reward_curve_png([0, 1, 2], [0.1, 0.4, 0.3], tmp_path / "c.png", [0, 0, 1])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_citations_follow_algorithm_estimator_and_lora():
    grpo = model_card.citations("grpo", "grpo", lora=False)
    assert len(grpo) == 1 and "2402.03300" in grpo[0]
    mixed = model_card.citations("grpo", "rloo", lora=True, extra=["X et al."])
    assert [c.split(",")[0] for c in mixed] == [
        "Shao et al. 2024",
        "Ahmadian et al. 2024",
        "Hu et al. 2021",
        "X et al.",
    ]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("embedded:smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("Qwen/Qwen2.5-0.5B-Instruct@v1.0", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("tiny:0", None),
        ("/abs/folder/model", None),
    ],
)
def test_public_base_model(policy, expected):
    assert model_card.public_base_model(policy) == expected


def test_relative_local_paths_keep_only_their_last_part(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "run" / "checkpoints").mkdir(parents=True)
    cleaned = model_card.clean_value(
        {"dirpath": "outputs/run/checkpoints", "repo": "org/name", "note": "a/b not here"}
    )
    assert cleaned == {"dirpath": "checkpoints", "repo": "org/name", "note": "a/b not here"}


@pytest.mark.parametrize(
    "local",
    [
        "file:///home/alice/runs/model.ckpt",
        "file://localhost/home/alice/runs/model.ckpt",
        "FILE:/home/alice/runs/model.ckpt",
        "file:///C:/Users/alice/runs/model.ckpt",
        "file:///home/alice/My%20Documents/runs",
        "file:///home/alice/My Documents/runs",
        "/home/alice/My Documents/runs",
        "/home/alice/My Documents/Run 3/model",
        "C:\\Users\\alice\\My Documents\\runs",
        "'/home/alice/My Documents'",
        '"file:///home/alice/My Documents"',
        "`/home/alice/a b/c d`",
        "~/runs/My Documents/x",
    ],
)
def test_scrub_removes_file_urls_and_paths_with_spaces_whole(local):
    out = model_card.scrub(f"saved in {local} and then more")
    assert "alice" not in out and "Documents" not in out and "runs" not in out, out
    assert "~" not in out
    assert model_card.LOCAL_PATH in out
    assert out.endswith(" and then more")  # the words after the path stay


def test_clean_value_treats_a_file_url_as_a_local_path():
    assert model_card.clean_value({"source": "file:///home/alice/d.jsonl"}) == {
        "source": model_card.LOCAL_PATH
    }


def test_card_with_file_urls_and_spaced_paths_names_no_one(tmp_path):
    facts = _facts(
        tmp_path,
        data_hparams={
            "source": "file:///home/alice/data/train.jsonl",
            "note": "copied from /home/alice/My Documents/sums to file:///srv/alice shared/x",
        },
    )
    text = model_card.render_card(model_card.card_context(facts, _record()))
    assert "alice" not in text and "My Documents" not in text and "shared/x" not in text
