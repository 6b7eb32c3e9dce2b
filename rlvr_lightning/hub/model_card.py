"""Model cards: Hub metadata, the training recipe, validation results and a reward curve.

A card is a Jinja template from ``rlvr_lightning.hub_cards`` (by name, e.g. ``default``) or any
``.jinja`` / ``.j2`` / ``.md`` file (by path), rendered with the context built by
``card_context``. The rendered text passes ``scrub``: Hub tokens and local absolute paths never
reach a card.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import inspect
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from rlvr_lightning.algorithms.presets import get_preset
from rlvr_lightning.hub import card_safety
from rlvr_lightning.hub.card_lines import hardware_line, multiturn_line
from rlvr_lightning.hub.card_safety import clean_value, public_base_model, scrub
from rlvr_lightning.hub.transfer import is_hub_name

LOCAL_PATH, REDACTED = card_safety.LOCAL_PATH, card_safety.REDACTED  # what cards show instead
_TEMPLATE_SUFFIXES = (".md.jinja", ".md.j2", ".jinja", ".j2")

CITATIONS: Mapping[str, str] = {
    "grpo": "Shao et al. 2024, DeepSeekMath: Pushing the Limits of Mathematical Reasoning in "
    "Open Language Models, arXiv:2402.03300 (GRPO)",
    "dapo": "Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale, "
    "arXiv:2503.14476",
    "dr_grpo": "Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective, "
    "arXiv:2503.20783 (Dr. GRPO)",
    "gspo": "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071",
    "cispo": "MiniMax 2025, MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning "
    "Attention, arXiv:2506.13585 (CISPO)",
    "rloo": "Ahmadian et al. 2024, Back to Basics: Revisiting REINFORCE Style Optimization for "
    "Learning from Human Feedback in LLMs, arXiv:2402.14740 (RLOO)",
    "lora": "Hu et al. 2021, LoRA: Low-Rank Adaptation of Large Language Models, arXiv:2106.09685",
}


@dataclass
class TrainingRecord:
    """What a card reports about a run; kept by the export callback and saved in checkpoints."""

    steps: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    tokens: int = 0  # generated completion tokens
    wall_time_s: float = 0.0
    validations: list[dict[str, Any]] = field(default_factory=list)  # {"step", "metrics"}

    def add_step(self, step: int, reward: float, accuracy: float, tokens: int) -> None:
        self.steps.append(step)
        self.rewards.append(reward)
        self.accuracies.append(accuracy)
        self.tokens += tokens

    def add_validation(self, step: int, metrics: Mapping[str, float]) -> None:
        self.validations.append({"step": step, "metrics": dict(metrics)})

    def before_after(self) -> tuple[dict[str, float] | None, dict[str, float] | None]:
        """The first validation at step 0 and the last one after training (None if missing)."""
        before = next((v["metrics"] for v in self.validations if v["step"] == 0), None)
        after = next((v["metrics"] for v in reversed(self.validations) if v["step"] > 0), None)
        return before, after


# ---- the pieces of a card --------------------------------------------------------------------


def card_metadata(
    *,
    base_model: str | None,
    license: str,
    algorithm: str,
    datasets: Sequence[str],
    model_name: str,
    dataset_type: str,
    dataset_name: str,
    results: Mapping[str, float] | None,
    extra_tags: Sequence[str] = (),
) -> str:
    """The YAML metadata block (without ``---``), in the form the Hub reads."""
    from huggingface_hub import EvalResult, ModelCardData

    evals = [
        EvalResult(
            task_type="text-generation",
            dataset_type=dataset_type,
            dataset_name=dataset_name,
            dataset_split="validation",
            metric_type=key.split("/")[-1],
            metric_name=key,
            metric_value=round(float(value), 4),
        )
        for key, value in sorted((results or {}).items())
    ]
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        license=license,
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(["rlvr", algorithm, "rlvr-lightning", *extra_tags])),
        datasets=list(datasets) or None,
        model_name=model_name,
        eval_results=evals or None,
    )
    return data.to_yaml()


def reward_curve_png(
    steps: Sequence[int],
    rewards: Sequence[float],
    path: str | Path,
    accuracies: Sequence[float] = (),
) -> Path:
    """Plot training reward (and accuracy) per step to a PNG with matplotlib's Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6, 3.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(list(steps), list(rewards), marker="o", markersize=3, label="train/reward")
    if accuracies:
        ax.plot(list(steps), list(accuracies), marker=".", label="train/accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("rollout step")
    ax.set_title("Training reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(str(path), format="png")
    return Path(path)


def citations(algorithm: str, estimator: str, lora: bool, extra: Sequence[str] = ()) -> list[str]:
    keys = [algorithm, estimator] + (["lora"] if lora else [])
    found = [CITATIONS[k] for k in dict.fromkeys(keys) if k in CITATIONS]
    return list(dict.fromkeys([*found, *extra]))


# ---- templates -------------------------------------------------------------------------------


def available_templates() -> list[str]:
    files = importlib.resources.files("rlvr_lightning.hub_cards").iterdir()
    return sorted(f.name.split(".")[0] for f in files if f.name.endswith(_TEMPLATE_SUFFIXES))


def template_source(template: str) -> str:
    """The text of a template given by file path, or by name from ``rlvr_lightning.hub_cards``."""
    path = Path(template).expanduser()
    if path.is_file():
        return path.read_text()
    package = importlib.resources.files("rlvr_lightning.hub_cards")
    for suffix in _TEMPLATE_SUFFIXES:
        candidate = package / f"{template}{suffix}"
        if candidate.is_file():
            return candidate.read_text()
    raise FileNotFoundError(
        f"No card template {template!r}: give a file path or one of {available_templates()}."
    )


def render_card(context: Mapping[str, Any], template: str = "default") -> str:
    """Render ``template`` with ``context`` (StrictUndefined: a missing key is an error)."""
    import jinja2

    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False
    )
    text = env.from_string(template_source(template)).render(**context)
    return scrub(text, roots=[Path.home(), Path.cwd()])


# ---- gathering the context from a run --------------------------------------------------------


def _callback_settings(callback: pl.Callback) -> dict[str, Any]:
    settings = {}
    for name in inspect.signature(type(callback).__init__).parameters:
        for attr in (name, f"_{name}", f"_{name}_"):
            value = getattr(callback, attr, inspect.Parameter.empty)
            if _is_plain(value):
                settings[name] = clean_value(value)
                break
    return settings


def _is_cosmetic(callback: pl.Callback) -> bool:
    # Progress bars, summaries and the CLI's config saver do not change what was trained.
    from lightning.pytorch.callbacks import ModelSummary, ProgressBar

    cosmetic = isinstance(callback, ProgressBar | ModelSummary)
    return cosmetic or type(callback).__name__ == "SaveConfigCallback"


def _is_plain(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(_is_plain(v) for v in value.values())
    return value is None or isinstance(value, str | int | float | bool | Path)


def _public_hparams(hparams: Mapping[str, Any], drop: Sequence[str] = ()) -> dict[str, Any]:
    # LightningCLI adds `_class_path` and `_instantiator`; they say nothing about training.
    return {k: v for k, v in hparams.items() if not k.startswith("_") and k not in drop}


def _recipe(hparams: Mapping[str, Any]) -> dict[str, Any]:
    preset = get_preset(hparams["algorithm"])
    given = {**(hparams.get("loss") or {}), "estimator": hparams.get("estimator")}
    pick = {
        k: (given.get(k) if given.get(k) is not None else getattr(preset, k))
        for k in ("clip_low", "clip_high", "agg_mode", "estimator")
    }
    loss = given.get("fn") or f"{preset.loss_fn.__module__}.{preset.loss_fn.__name__}"
    return {"algorithm": hparams["algorithm"], "loss_fn": loss, **pick}


@dataclass
class RunFacts:
    """What a card needs from the run besides the ``TrainingRecord``; all plain data."""

    hparams: dict[str, Any]
    data_hparams: dict[str, Any]
    rewards: list[dict[str, Any]]  # {"name", "weight"}
    accuracy_reward: str | None
    callbacks: list[dict[str, Any]]  # {"name", "settings"}
    steps: int
    hardware: str
    extra_citations: list[str] = field(default_factory=list)


def _reward_specs(module: Any) -> list[dict[str, Any]]:
    return [{"name": s.name, "weight": s.weight} for s in getattr(module.rewards, "specs", ())]


def run_facts(trainer: pl.Trainer, module: Any) -> RunFacts:
    """Facts of a live run: module and data module hyperparameters, callbacks, hardware."""
    return RunFacts(
        hparams=dict(module.hparams),
        data_hparams=dict(getattr(trainer.datamodule, "hparams", {}) or {}),
        rewards=_reward_specs(module),
        accuracy_reward=getattr(module, "accuracy_reward", None),
        callbacks=[
            {"name": type(cb).__name__, "settings": _callback_settings(cb)}
            for cb in trainer.callbacks
            if not _is_cosmetic(cb)
        ],
        steps=int(trainer.global_step),
        hardware=hardware_line(trainer),
        extra_citations=[c for cb in trainer.callbacks for c in getattr(cb, "citations", ())],
    )


def checkpoint_facts(checkpoint: Mapping[str, Any], module: Any) -> RunFacts:
    """Facts recoverable from a Lightning checkpoint (hardware and callbacks are unknown)."""
    callbacks = [
        {"name": key.split("{")[0], "settings": {}} for key in checkpoint.get("callbacks", {})
    ]
    return RunFacts(
        hparams=dict(module.hparams),
        data_hparams=dict(checkpoint.get("datamodule_hyper_parameters", {}) or {}),
        rewards=_reward_specs(module),
        accuracy_reward=getattr(module, "accuracy_reward", None),
        callbacks=callbacks,
        steps=int(checkpoint.get("global_step", 0)),
        hardware="not recorded in the checkpoint",
    )


_DETAIL = re.compile(
    r"^(?P<key>.+/pass@\d+)_(?:ci(?P<level>\d+)_(?P<end>low|high)|(?P<count>prompts|samples))"
    r"(?P<split>_[a-z]+)?$"  # a validation split's suffix (``_paraphrased``)
)


def split_details(metrics: Mapping[str, float] | None) -> tuple[dict[str, float] | None, dict]:
    """``metrics`` without pass@k's interval and counts, and those as one note per pass@k key
    (``{"val/pass@4": "95% CI 0.26–1.00, 32 samples over 8 prompts"}``)."""
    if metrics is None:
        return None, {}
    main: dict[str, float] = {}
    parts: dict[str, dict[str, Any]] = {}
    for key, value in metrics.items():
        match = _DETAIL.match(key)
        if match is None:
            main[key] = value
            continue
        part = parts.setdefault(match["key"] + (match["split"] or ""), {"level": "95"})
        part[match["end"] or match["count"]] = value
        part["level"] = match["level"] or part["level"]
    return main, {key: _interval_note(part) for key, part in parts.items()}


def _interval_note(part: Mapping[str, Any]) -> str:
    low, high = part.get("low", math.nan), part.get("high", math.nan)
    counts = f"{part.get('samples', 0):.0f} samples over {part.get('prompts', 0):.0f} prompts"
    return f"{part['level']}% CI {low:.2f}–{high:.2f}, {counts}"


def card_context(
    facts: RunFacts,
    record: TrainingRecord,
    *,
    repo_id: str | None = None,
    license: str = "apache-2.0",
    adapter_only: bool = False,
    reward_curve: str | None = None,
    base_model: str | None = None,
) -> dict[str, Any]:
    """Everything a template may use: ``metadata`` (YAML), recipe, results, usage, citations;
    ``base_model`` (the export's ``--base-model``) replaces the policy as the base's name."""
    hparams, source = facts.hparams, str(facts.data_hparams.get("source", "unknown"))
    recipe = _recipe(hparams)
    (before, before_notes), (after, after_notes) = map(split_details, record.before_after())
    base_model = public_base_model(base_model or str(hparams.get("policy", "")))
    dataset_type = Path(source).stem if os.path.isabs(source) else source
    datasets = [source] if is_hub_name(source) and "/" in source else []
    model_name = (repo_id or "rlvr-lightning-model").split("/")[-1]
    return {
        "metadata": card_metadata(
            base_model=base_model,
            license=license,
            algorithm=recipe["algorithm"],
            datasets=datasets,
            model_name=model_name,
            dataset_type=dataset_type,
            dataset_name=f"{dataset_type} (held-out)",
            results=after or before,
        ),
        "model_name": model_name,
        "repo_id": repo_id,
        "base_model": base_model,
        "adapter_only": adapter_only,
        "recipe": clean_value(recipe),
        "hparams": clean_value(_public_hparams(hparams, drop=["policy"])),
        "policy": clean_value(hparams.get("policy")),
        "rewards": clean_value(facts.rewards),
        "accuracy_reward": facts.accuracy_reward,
        "data": clean_value(_public_hparams(facts.data_hparams)),
        "callbacks": facts.callbacks,
        "steps": facts.steps,
        "rollout_steps": len(record.steps),
        "tokens": int(record.tokens),
        "hardware": facts.hardware,
        "multiturn": multiturn_line(hparams.get("multiturn")),
        "wall_time": _duration(record.wall_time_s),
        "before": before,
        "after": after,
        "before_notes": before_notes,
        "after_notes": after_notes,
        "reward_curve": reward_curve,
        "reward_history": list(zip(record.steps, record.rewards, strict=True)),
        "citations": citations(
            recipe["algorithm"],
            str(recipe["estimator"]),
            int((hparams.get("lora") or {}).get("rank", 0) or 0) > 0,
            facts.extra_citations,
        ),
    }


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min {secs} s" if hours else f"{minutes} min {secs} s"


def record_from_dict(data: Mapping[str, Any]) -> TrainingRecord:
    names = {f.name for f in dataclasses.fields(TrainingRecord)}
    return TrainingRecord(**{k: v for k, v in data.items() if k in names})
