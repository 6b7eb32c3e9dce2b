"""Every pair of mechanisms that can be switched on together, on one hand-made step.

Three prompts, G = 4, the sampled outcome set by hand: ``[1,0,0,0]``, ``[1,1,1,1]``,
``[0,0,0,0]`` (pass rates 1/4, 1, 0); the reward is the accuracy (0/1), every reference,
teacher, stored trajectory and guide sample is correct. The step runs as ``training_step``
does (hooks, π_old, selection, advantages, the data module's observation), without the
update. Each mechanism then checks the signal it decides from against values worked out by
hand here: the trained group's correct count ``K`` for every set of injectors (``TRAINED_K``,
from the composition rules: ``append`` takes the last on-policy slot, ``replace_random`` an
incorrect one), and from it informative groups, the κ mask and the advantages. Pairs that
cannot work together are refused at setup: ``test_combination_refusals.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from rlvr_lightning.callbacks import (
    AdaptiveTemperature,
    AnnealedTemperature,
    GroundTruthInjection,
    MixedPolicyGuidance,
    NearFuturePolicyGuidance,
)

from rlvr_lightning import RLVRModule
from rlvr_lightning.algorithms.correction import correction_weights
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.data.curriculum import VarianceCurriculum
from rlvr_lightning.data.replay import PromptReplay
from rlvr_lightning.device import completion_logprobs, prepare_model
from rlvr_lightning.guidance.experience import Trajectory
from rlvr_lightning.heads import ProbeHead, ValueHead
from rlvr_lightning.options import Correction
from rlvr_lightning.rewards import extract_boxed
from rlvr_lightning.stages.dynamic import keep_first, refill
from rlvr_lightning.stages.hooks import run_hooks
from rlvr_lightning.stages.summary import summarise_step
from rlvr_lightning.testing import grouped
from rlvr_lightning.types import Rollouts, Sampling

MECHANISMS = (
    "dynamic_sampling", "replay", "curriculum", "gt_injection", "luffy", "ampo", "exgrpo",
    "npo", "erpo", "ead", "tis", "top_p_k", "value_head", "probe_head",
)  # fmt: skip
REFUSED = {  # pairs refused at setup, with a message: test_combination_refusals.py
    frozenset({"value_head", "probe_head"}),
    frozenset({"gt_injection", "value_head"}),
    frozenset({"gt_injection", "probe_head"}),
}
PAIRS = [p for p in itertools.combinations(MECHANISMS, 2) if frozenset(p) not in REFUSED]
G, SAMPLED = 4, [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
EXTRA = [1, 0, 1, 0]  # dynamic sampling's extra groups
INJECTORS = ("gt_injection", "luffy", "ampo", "exgrpo", "npo")  # hook order, as listed
# The trained group's correct count per injector set, by hand. GT: the all-wrong group gets its
# reference in the last slot. LUFFY: every group's last on-policy slot. AMPO: 2 incorrect
# slots of the all-wrong group. ExGRPO: the pooled question (mixed into the last prompt's
# place, sampled all wrong) gets its trajectory in the last on-policy slot. NPO: one incorrect
# slot of every group whose sampled accuracy is below 0.6 (groups 0 and 2).
TRAINED_K = {
    (): [1, 4, 0], ("gt_injection",): [1, 4, 1], ("luffy",): [2, 4, 1], ("ampo",): [1, 4, 2],
    ("exgrpo",): [1, 4, 1], ("npo",): [2, 4, 1],
    ("gt_injection", "luffy"): [2, 4, 2], ("gt_injection", "ampo"): [1, 4, 3],
    ("gt_injection", "exgrpo"): [1, 4, 2], ("gt_injection", "npo"): [2, 4, 2],
    ("luffy", "ampo"): [2, 4, 3], ("luffy", "exgrpo"): [2, 4, 2], ("luffy", "npo"): [3, 4, 2],
    ("ampo", "exgrpo"): [1, 4, 3], ("ampo", "npo"): [2, 4, 3], ("exgrpo", "npo"): [2, 4, 2],
}  # fmt: skip
# EAD with c = 0 at step 0: τ_t = max(2.2 - exp(t / 200), 0.1).
EAD_FACTORS = [1.2, 2.2 - 1.0050125, 2.2 - 1.0100502, 2.2 - 1.0151131]


def boxed_match(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(extract_boxed(c) == str(a)) for c, a in zip(completions, answer, strict=True)]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("combinations") / "train.jsonl"
    teacher = ["So \\boxed{7}", "Hence \\boxed{7}"]
    rows = [{"prompt": f"q{i}", "answer": "7", "teacher_responses": teacher} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MODULES: dict[tuple, RLVRModule] = {}


def _module(on: set[str]) -> RLVRModule:
    """The module for ``on``, shared by the pairs that configure it alike (no update runs;
    the probe head, which buffers the step's rows, is replaced by an empty one)."""
    key = tuple(sorted(on & {"dynamic_sampling", "tis", "top_p_k", "value_head", "probe_head"}))
    if key not in MODULES:
        MODULES[key] = _build_module(on)
        prepare_model(MODULES[key].policy, "cpu")  # what setup does for the run's device
    module = MODULES[key]
    if module.probe_head is not None:  # an empty buffer: bootstrapping
        module.probe_head = ProbeHead(module.probe_head.hidden_size)
    return module


def _build_module(on: set[str]) -> RLVRModule:
    top = {"top_p": 0.7} if "top_p_k" in on else {}
    kwargs: dict = dict(
        reward_fns=[boxed_match], isolate=False, estimator="dr_grpo", prompt_format="plain",
        sampling=Sampling(max_new_tokens=4, group_size=G, **top),
        dynamic_sampling="dynamic_sampling" in on,
    )  # fmt: skip
    if "tis" in on:
        kwargs["correction"] = Correction(old_logprobs="trainer", mode="tis", cap=2.0)
    if "value_head" in on:
        kwargs.update(estimator="gae", value_head=ValueHead)
    if "probe_head" in on:
        kwargs.update(estimator="probe", probe_head=ProbeHead)
    return RLVRModule("tiny:0", **grouped(**kwargs))


class StubGuide:
    """NPO's guide, sampled: one correct ``\\boxed{7}`` per prompt (the guide's sampling is
    the guide model's business; what matters here is how its rows join the groups)."""

    samples = 1

    def sample(self, module: RLVRModule, prompts) -> tuple[Rollouts, torch.Tensor]:
        ids, mask = module.encode_prompts(prompts)  # [n, P]
        tok = module.tokenizer("\\boxed{7}", add_special_tokens=False).input_ids
        tok = torch.tensor([*tok, module.tokenizer.eos_token_id]).expand(len(prompts), -1)
        n = len(prompts)
        rollouts = Rollouts(
            ids, mask, tok.clone(), torch.ones_like(tok), torch.zeros(tok.shape), torch.ones(n),
            torch.zeros(n, dtype=torch.bool), ["\\boxed{7}"] * n, 1,
        )  # fmt: skip
        return rollouts, torch.ones(n, dtype=torch.bool)


def _callbacks(on: set[str], module: RLVRModule) -> list:
    made = {
        "exgrpo": lambda: MixedPolicyGuidance(
            source="experience", injection="always", experience_ratio=0.34
        ),
        "erpo": AdaptiveTemperature,
        "ead": lambda: AnnealedTemperature(c=0),
        "gt_injection": GroundTruthInjection,
        "luffy": lambda: MixedPolicyGuidance(source="reference", injection="always"),
        "ampo": lambda: MixedPolicyGuidance(
            source="teacher", injection="on_all_fail", num_replaced=2, reward=1.0
        ),
        "npo": lambda: NearFuturePolicyGuidance(
            mode="manual", guide_checkpoint="unused", intervene_at=[0]
        ),
    }
    order = ("exgrpo", "erpo", "ead", *INJECTORS[:-2], "npo")
    return [made[name]() for name in order if name in on]


def _step(on: set[str], data_file) -> SimpleNamespace:
    module = _module(on)
    replay = PromptReplay(cooldown_steps=0) if "replay" in on else None
    curriculum = VarianceCurriculum(0.3, 0.3) if "curriculum" in on else None
    dm = RLVRDataModule(
        source=str(data_file), val_size=2, prompts_per_step=3, replay=replay,
        curriculum=curriculum, instruction=None,
    )  # fmt: skip
    dm.setup("fit")
    callbacks = _callbacks(on, module)
    trainer = SimpleNamespace(
        datamodule=dm, callbacks=callbacks, global_step=0, max_steps=10, current_epoch=0,
        precision="32-true",
    )  # fmt: skip
    module._trainer = trainer
    for cb in callbacks:
        if not isinstance(cb, NearFuturePolicyGuidance):  # its guide file: the stub below
            cb.setup(trainer, module, "fit")
    batch = dm.compose_step()
    _prime(callbacks, module, batch)
    patterns = iter([SAMPLED, *[[EXTRA] * 3] * 3])
    batch = run_hooks(trainer, module, "on_before_rollout", batch)

    def generate(b):
        b = run_hooks(trainer, module, "on_before_generate", b)
        scored = _outcome(module.score(b, _rollout(module, b)), next(patterns)[: len(b)])
        module.step_batch = b
        return run_hooks(trainer, module, "on_after_score", scored)

    scored = generate(batch)
    round0 = scored
    if "dynamic_sampling" in on:
        r = refill(batch, scored, module.select_groups, dm.draw_prompts, generate, 3, 0)
        batch, scored = r.batch, r.scored
    scored, _ = module.recompute_old_logprobs(scored)
    groups = module.select_groups(batch, scored)  # [B']
    if "dynamic_sampling" in on:
        groups = keep_first(groups, 3)
    scored = dataclasses.replace(scored, trained_groups=groups)
    adv = module.compute_advantages(scored)
    out = summarise_step(0, batch, scored, adv, {}, lr=0.0, trained=groups)
    dm.on_step_output(out)
    module._trainer = None  # the callbacks' module.log: no logger here
    run_hooks(trainer, module, "on_step_output", out)
    return SimpleNamespace(
        module=module, dm=dm, batch=batch, round0=round0, scored=scored, groups=groups, adv=adv,
        out=out, callbacks=callbacks,
    )  # fmt: skip


ROLLOUTS: dict[tuple, Rollouts] = {}


def _rollout(module: RLVRModule, batch) -> Rollouts:
    """``module.rollout``, seeded, once per module and sampling input (pairs share most)."""
    schedule = batch.position_temperatures
    key = (
        id(module), tuple(batch.prompt_ids), tuple(batch.temperatures or ()),
        None if schedule is None else tuple(schedule.tolist()),
    )  # fmt: skip
    if key not in ROLLOUTS:
        torch.manual_seed(len(batch.prompt_ids))
        ROLLOUTS[key] = module.rollout(batch)
    return ROLLOUTS[key]


def _prime(callbacks: list, module: RLVRModule, batch) -> None:
    """State a callback would carry from earlier steps: ExGRPO's pooled question, ERPO's
    raised temperature of the second prompt (all correct last step), NPO's active guide."""
    for cb in callbacks:
        if isinstance(cb, MixedPolicyGuidance) and cb.source == "experience":
            tok = module.tokenizer("\\boxed{7}", add_special_tokens=False).input_ids
            tok = [*tok, module.tokenizer.eos_token_id]
            traj = Trajectory(tok, [-0.5] * len(tok), 1.0, "\\boxed{7}")
            columns = {k: v[0] for k, v in batch.columns.items()}  # as recorded from a batch
            prompt = {"messages": [{"role": "user", "content": "pooled"}], "columns": columns}
            cb.pool.record("pooled", prompt, 2, G, [traj])
        if isinstance(cb, AdaptiveTemperature):
            cb.temperatures = {batch.prompt_ids[1]: 1.2}
        if isinstance(cb, NearFuturePolicyGuidance):
            cb.guide, cb.active_until = StubGuide(), 5


def _outcome(scored, pattern: list[list[int]]):
    """The sampled outcome set by hand: ``correct`` and the reward (= accuracy)."""
    correct = torch.tensor(pattern, dtype=torch.bool).reshape(-1)  # [N]
    rewards = correct.float()
    return dataclasses.replace(
        scored, correct=correct, rewards=rewards, sampled_correct=correct,
        sampled_rewards=rewards, per_function={"boxed_match": rewards.clone()},
    )  # fmt: skip


@pytest.mark.parametrize("pair", PAIRS, ids="+".join)
def test_each_mechanism_decides_from_its_hand_computed_signals(pair, data_file):
    on = set(pair)
    s = _step(on, data_file)
    k = TRAINED_K[tuple(m for m in INJECTORS if m in on)]
    _check_outcome(s, on, k)
    _check_selection(s, on, k)
    _check_advantages(s, on, k)
    _check_old_logprobs(s, on)
    _check_temperatures(s, on)


# ---- the checks, each against the hand-made step ---------------------------------------------

MEMBERS = {  # injector -> {group: source tags it adds}
    "gt_injection": {2: ["reference"]},
    "luffy": {0: ["reference"], 1: ["reference"], 2: ["reference"]},
    "ampo": {2: ["teacher", "teacher"]},
    "exgrpo": {2: ["experience"]},
    "npo": {0: ["npo"], 2: ["npo"]},
}


def _check_outcome(s: SimpleNamespace, on: set[str], k: list[int]) -> None:
    """Pass rates read the sampled rows; the trained groups hold exactly the hand table's
    members; replay, the curriculum's bank, ExGRPO's pool and skip set read the sampled rate."""
    extra = len(s.out.prompt_ids) - 3
    assert s.out.pass_rate.tolist() == [0.25, 1.0, 0.0] + [0.5] * extra
    assert s.scored.correct.view(-1, G)[:3].sum(1).tolist() == k
    tags = s.scored.rollouts.sources or ("policy",) * s.scored.rollouts.num_rows
    for b in range(3):
        want = sorted(t for m in on if m in MEMBERS for t in MEMBERS[m].get(b, []))
        assert sorted(t for t in tags[b * G : b * G + G] if t != "policy") == want
    ids = s.out.prompt_ids
    if "replay" in on:  # admitted: 0 < p in [0.25, 0.75]; p = 0 goes to zero_pass
        assert {key[3] for key in s.dm.replay.heap} == {ids[0], *ids[3:]}
        assert ids[2] in s.dm.replay.zero_pass
    if "curriculum" in on:  # bank: sampled score 4k(G-k)/G^2 >= 0.75: 3/4 for k = 1, 1 for k = 2
        assert set(s.dm.curriculum.bank.entries) == {ids[0], *ids[3:]}
    if "exgrpo" in on:
        pool = s.callbacks[0].pool
        assert ids[2] == "pooled" and "pooled" not in pool.entries  # seen at k = 0 (E1)
        assert ids[0] in pool.entries and s.dm.composer.retired == {ids[1]}  # K/K (D4)
        # Stored: the trainer's π_old where the sampler is not the trainer (E4), else its own.
        traj, r0 = pool.trajectories(ids[0])[0], s.round0.rollouts
        n = len(traj.token_ids)
        want = _full_logprobs(s.module, r0) if on & {"ead", "top_p_k", "tis"} else r0.behaviour_logp
        torch.testing.assert_close(
            torch.tensor(traj.behaviour_logp), want[0, :n], atol=1e-4, rtol=0
        )


def _check_selection(s: SimpleNamespace, on: set[str], k: list[int]) -> None:
    """Informative as trained (0 < K < G) and the κ mask (4K(G-K)/G^2 >= 0.3: the same K for
    G = 4); dynamic sampling keeps the first 3 informative groups of all rounds."""
    informative = [0 < x < G for x in k]
    filtered = bool(on & {"dynamic_sampling", "curriculum"})
    assert s.groups[:3].tolist() == (informative if filtered else [True] * 3)
    if "dynamic_sampling" in on:
        assert int(s.groups.sum()) == 3 and s.groups[3:].sum() == 3 - sum(informative)
    else:
        assert len(s.groups) == 3


def _check_advantages(s: SimpleNamespace, on: set[str], k: list[int]) -> None:
    """By hand from the trained correct counts (reward = accuracy)."""
    adv, rows = s.adv, s.scored.rollouts
    if "value_head" in on:  # V_old = 0 (zero-initialised head): Â_t = r, whitened over the
        mask = rows.completion_mask.bool()  # trained groups' tokens only (E5)
        raw = s.scored.rewards.float()[:, None].expand(mask.shape)
        stat = mask & s.groups.repeat_interleave(G)[:, None]
        mean, var = raw[stat].mean(), raw[stat].var()
        torch.testing.assert_close(adv[mask], ((raw - mean) / (var + 1e-8).sqrt())[mask])
        return
    for b, kb in enumerate(k):
        got = sorted(adv[b * G : b * G + G].tolist())
        if "probe_head" in on:  # bootstrapping: RLOO, r - mean of the other three
            want = [-kb / 3] * (G - kb) + [1 - (kb - 1) / 3] * kb
        elif "gt_injection" in on and b == 2:  # reference out of the baseline, capped at 2/3
            m = (kb - 1) / 3  # the other three rows' mean
            want = [-m] * (G - kb) + [1 - m] * (kb - 1) + [min(1 - m, 2 / 3)]
        else:  # dr_grpo: r - mean
            want = [-kb / G] * (G - kb) + [1 - kb / G] * kb
        assert got == pytest.approx(sorted(want), abs=1e-5)


def _full_logprobs(module: RLVRModule, r: Rollouts) -> torch.Tensor:
    with torch.no_grad():
        return completion_logprobs(
            module.policy, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
            torch.ones(r.num_rows),
        )[0]  # fmt: skip


def _check_old_logprobs(s: SimpleNamespace, on: set[str]) -> None:
    """π_old is the trainer's full softmax at the base temperature wherever the sampler is not
    the trainer (TIS's ``old_logprobs: trainer``, top-p, ERPO's and EAD's temperatures);
    injected tokens keep their stored log-probs; TIS weights are ``min(π_old / π_beh, 2)``."""
    r = s.scored.rollouts
    if not on & {"tis", "top_p_k", "erpo", "ead"}:
        assert r.old_logp is None  # the sampler is the trainer: behaviour_logp is π_old
        return
    full = _full_logprobs(s.module, r)  # [N, T]
    valid = r.completion_mask.bool()
    off = valid & (r.offpolicy_mask.bool() if r.offpolicy_mask is not None else False)
    sampled = valid & ~off
    old = r.old_logp
    heads = bool(on & {"value_head", "probe_head"})
    assert bool(old[sampled].isnan().all()) != heads  # deferred to the update's forward
    filled = torch.where(old.isnan(), full, old)
    torch.testing.assert_close(filled[sampled], full[sampled], atol=1e-4, rtol=0)
    torch.testing.assert_close(old[off], r.behaviour_logp[off].float())
    if "tis" in on:
        weights = correction_weights(filled, r.behaviour_logp, r.completion_mask, "tis", 2.0)
        want = torch.exp(full - r.behaviour_logp).clamp(max=2.0)
        torch.testing.assert_close(weights[sampled], want[sampled], atol=1e-4, rtol=1e-4)
        assert bool((weights[off] == 1.0).all())


def _check_temperatures(s: SimpleNamespace, on: set[str]) -> None:
    """What ERPO and EAD sampled at, and what the top-p sampler recorded."""
    r = s.round0.rollouts  # before π_old's recomputation reset the temperatures
    policy = torch.tensor([t == "policy" for t in (r.sources or ("policy",) * r.num_rows)])
    row_t = torch.ones(r.num_rows)
    if "erpo" in on:  # the second prompt was all correct last step: 1.2, then 1.2 + 0.1
        row_t[G : 2 * G] = 1.2
        erpo = next(cb for cb in s.callbacks if isinstance(cb, AdaptiveTemperature))
        assert erpo.temperatures == {s.out.prompt_ids[1]: pytest.approx(1.3)}
    torch.testing.assert_close(r.temperature[policy], row_t[policy])
    if "ead" in on:  # sampled rows end within max_new_tokens = 4 (members may be longer)
        valid = (r.completion_mask.bool() & policy[:, None])[:, :4]
        want = row_t[:, None] * torch.tensor(EAD_FACTORS)
        got = r.position_temperature[:, :4]
        torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)
    if "top_p_k" in on and not on & {"erpo", "ead"}:  # the nucleus' log-probs >= the softmax's
        valid = r.completion_mask.bool() & policy[:, None]
        full = _full_logprobs(s.module, r)
        assert bool((r.behaviour_logp[valid] >= full[valid] - 1e-4).all())
