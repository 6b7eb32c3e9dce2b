"""ProbeHead: layer features from the trainer pass, the sibling baseline, the RLOO bootstrap,
the FIFO buffer and refit schedule, and the export that loads on its own."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rlvr_lightning.algorithms import advantages
from rlvr_lightning.algorithms.ops import last_n_mean
from rlvr_lightning.device import trainer_forward
from rlvr_lightning.device.forward import completion_forward
from rlvr_lightning.device.layer_states import layer_module
from rlvr_lightning.heads import ProbeHead
from rlvr_lightning.hub import save_heads
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.testing import tiny_policy
from rlvr_lightning.types import Sampling, Scored

H = 32  # tiny_policy's hidden size


def _rollouts(seed: int = 0, group_size: int = 2):
    model, tok = tiny_policy(seed=seed)
    tok.padding_side = "left"
    enc = tok(["ab", "hello there", "xyz"], return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    rollouts = HFEngine(model, tok).generate(
        enc.input_ids, enc.attention_mask, Sampling(max_new_tokens=8, group_size=group_size)
    )
    return model, rollouts


def _scored(rollouts, rewards: torch.Tensor, features: torch.Tensor | None = None) -> Scored:
    r = dataclasses.replace(rollouts, probe_features=features)
    return Scored(r, rewards, {}, rewards > 0.5)


def _fitted(seed: int = 0, rows: int = 64, **kwargs) -> tuple[ProbeHead, torch.Tensor]:
    """A head fitted on random features whose target depends on them, and the features."""
    gen = torch.Generator().manual_seed(seed)
    head = ProbeHead(H, prompt_pca=4, response_pca=4, alpha=1.0, **kwargs)
    features = torch.randn(rows, head.num_features, generator=gen)  # [M, F]
    head.buffer_features[:rows] = features
    head.buffer_targets[:rows] = (0.5 + 0.2 * features[:, 0] - 0.2 * features[:, H]).clamp(0, 1)
    head.buffer_count.fill_(rows)
    head.steps_observed.fill_(head.bootstrap_steps)
    head.refit()
    return head, features


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("layer", [-1, 1, 0])
def test_layer_means_are_those_of_output_hidden_states(share: bool, layer: int) -> None:
    model, r = _rollouts(seed=1)
    args = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.temperature)
    with torch.no_grad():
        out = completion_forward(model, *args, share_prompts=share, layer_means=(layer, 3))
        ids = torch.cat([r.prompt_ids, r.completion_ids[:, :-1]], dim=1)  # [n, P + T - 1]
        attn = torch.cat([r.prompt_mask, r.completion_mask[:, :-1]], dim=1)
        full = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
            output_hidden_states=True,
        ).hidden_states[layer]  # [n, P + T - 1, H]
    p = r.prompt_ids.shape[1]
    prompt = last_n_mean(full[:, :p], r.prompt_mask, 3)  # [n, H]
    response = last_n_mean(full[:, p - 1 :], r.completion_mask, 3)  # [n, H]
    torch.testing.assert_close(out.layer_means[0], prompt, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.layer_means[1], response, atol=1e-5, rtol=1e-4)


def test_layer_numbering_and_its_range_error() -> None:
    model, _ = tiny_policy()  # 2 blocks
    assert layer_module(model, -1) is model.model.norm
    assert layer_module(model, 2) is model.model.norm
    assert layer_module(model, 1) is model.model.layers[0]
    assert layer_module(model, 0) is model.model.embed_tokens
    with pytest.raises(ValueError, match="out of range"):
        layer_module(model, 3)


def test_trainer_pass_gives_the_features_of_the_update_forward() -> None:
    model, r = _rollouts(seed=2)
    head = ProbeHead(H, last_tokens=4)
    logp, values, features = trainer_forward(model, r, micro_batch_size=2, probe=head)
    assert values is None and features.shape == (r.num_rows, 2 * H + 1)
    with torch.no_grad():
        out = completion_forward(
            model,
            *(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.temperature),
            with_entropy=True,
            layer_means=(-1, 4),
        )
    mask = r.completion_mask.float()
    entropy = (out.entropy * mask).sum(-1) / mask.sum(-1)  # [N]
    expected = torch.cat([*out.layer_means, entropy[:, None]], dim=-1)  # [N, F]
    torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logp, out.logp * mask, atol=1e-5, rtol=1e-5)


def test_a_rows_own_features_never_move_its_baseline() -> None:
    head, features = _fitted()
    _, r = _rollouts(group_size=2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # [N], 3 groups of 2
    z = features[:6].clone()  # [N, F]

    def baselines(z: torch.Tensor) -> torch.Tensor:
        kwargs = head.estimator_kwargs(_scored(r, rewards, z))
        return rewards - advantages.compute_advantages(rewards, 2, "probe", **kwargs)  # [N]

    before = baselines(z)
    moved = z.clone()
    moved[0] += 5.0  # row 0's state changes a lot
    after = baselines(moved)
    # Equal up to float rounding of the batched matmul (~1e-8).
    torch.testing.assert_close(after[0], before[0], atol=1e-6, rtol=0)  # b_0 reads row 1 only
    assert abs(float(after[1] - before[1])) > 1e-3  # b_1 reads row 0: the test can fail
    torch.testing.assert_close(after[2:], before[2:], atol=1e-6, rtol=0)
    # G = 2: b_1 = g(z_2), b_2 = g(z_1).
    torch.testing.assert_close(before[:2], head.predict(z[:2]).flip(0))


def test_bootstrap_advantages_are_rloo() -> None:
    head, features = _fitted(bootstrap_steps=3)
    head.steps_observed.fill_(2)  # fitted, but still bootstrapping
    _, r = _rollouts(group_size=3)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 1.0, 0.25])  # [N]
    scored = _scored(r, rewards, features[:9])
    assert not head.active
    adv = advantages.compute_advantages(rewards, 3, "probe", **head.estimator_kwargs(scored))
    torch.testing.assert_close(adv, advantages.rloo_advantages(rewards, 3))
    head.steps_observed.fill_(3)
    assert head.active
    adv = advantages.compute_advantages(rewards, 3, "probe", **head.estimator_kwargs(scored))
    assert not torch.allclose(adv, advantages.rloo_advantages(rewards, 3))


def test_observe_fills_a_fifo_of_whole_groups_and_refits_on_schedule() -> None:
    head = ProbeHead(H, prompt_pca=2, response_pca=2, warmup_steps=2, refit_every=2, buffer_rows=5)
    _, r = _rollouts(group_size=2)  # 6 rows, 3 groups
    gen = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # [N]
    log = []
    for _ in range(4):
        z = torch.randn(6, head.num_features, generator=gen)  # [N, F]
        log.append(head.observe(_scored(r, rewards, z)))
    # Step 1: 6 rows > 5, overflow 1 cuts group 0, so groups 1, 2 stay (4 rows); each later
    # step adds 3 groups and keeps the newest 2.
    assert [m["probe/buffer_rows"] for m in log] == [4.0] * 4
    assert head.buffer_groups[:4].tolist() == [10, 10, 11, 11]
    # Targets are the siblings' rewards: group 11 = [1, 1] -> [1, 1]; group 10 = [0, 0].
    assert head.buffer_targets[:4].tolist() == [0.0, 0.0, 1.0, 1.0]
    # Refit after steps 2 and 4 (warm-up 2, then every 2); nothing before step 2.
    assert [m["probe/refit"] for m in log] == [0.0, 1.0, 0.0, 1.0]
    assert [m["probe/fitted"] for m in log] == [0.0, 1.0, 1.0, 1.0]
    assert "probe/fit_r2" not in log[0] and all(
        torch.isfinite(torch.tensor(m["probe/fit_corr"])) for m in log[1:]
    )


def test_export_holds_the_fit_not_the_buffer_and_loads_on_its_own(tmp_path) -> None:
    head, features = _fitted(reward_range=(0.0, 1.5), layer=1, last_tokens=3)
    written = save_heads({"probe_head": head}, tmp_path)
    assert sorted(p.name for p in written) == ["probe_head.json", "probe_head.safetensors"]
    assert json.loads((tmp_path / "probe_head.json").read_text())["layer"] == 1
    loaded = ProbeHead.from_pretrained(tmp_path)
    assert loaded.fitted and int(loaded.buffer_count) == 0
    assert (loaded.layer, loaded.last_tokens, loaded.reward_range) == (1, 3, (0.0, 1.5))
    torch.testing.assert_close(loaded.predict(features), head.predict(features))
    model, r = _rollouts(seed=3)
    torch.testing.assert_close(loaded.score_rollouts(model, r), head.score_rollouts(model, r))


def test_probe_head_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="last_tokens"):
        ProbeHead(H, last_tokens=0)
    with pytest.raises(ValueError, match="bootstrap_steps"):
        ProbeHead(H, buffer_rows=1)
    assert ProbeHead(8, prompt_pca=32).probe.prompt_components.shape == (8, 8)  # clamped to H
