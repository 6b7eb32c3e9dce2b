import torch

from rlvr_lightning.algorithms.losses import ppo_clip_loss
from rlvr_lightning.device.forward import completion_logprobs, group_microbatches
from rlvr_lightning.device.shared_prompts import length_buckets
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.stages.update import PolicyUpdate
from rlvr_lightning.testing import tiny_policy
from rlvr_lightning.types import Sampling


def test_microbatches_keep_groups_together():
    groups = torch.tensor([2, 0, 1, 0, 2, 1])
    batches = group_microbatches(groups, 2)
    # positions sorted by group, stable: group 0 -> [1, 3], group 1 -> [2, 5], group 2 -> [0, 4]
    assert [b.tolist() for b in batches] == [[1, 3], [2, 5], [0, 4]]


def _rollouts(seed=0):
    model, tok = tiny_policy(seed=seed)
    tok.padding_side = "left"
    engine = HFEngine(model, tok)
    enc = tok(["ab", "hello there"], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    return model, engine.generate(
        enc.input_ids, enc.attention_mask, Sampling(max_new_tokens=8, group_size=3)
    )


def _grads(model, rollouts, micro, mode):
    model.zero_grad()
    upd = PolicyUpdate(
        loss_fn=ppo_clip_loss,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        agg_mode=mode,
        norm_len=8,
        kl_coef=0.0,
        kl_estimator="k3",
        entropy_coef=0.0,
        micro_batch_size=micro,
    )
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    rows = torch.arange(6)
    loss, _ = upd.accumulate(model, rollouts, adv, rows, lambda f: None, lambda x: x.backward())
    return loss, [p.grad.clone() for p in model.parameters()]


def test_micro_batching_gives_the_full_batch_gradient():
    model, rollouts = _rollouts()
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        full_loss, full = _grads(model, rollouts, micro=6, mode=mode)
        part_loss, part = _grads(model, rollouts, micro=2, mode=mode)
        assert abs(full_loss - part_loss) < 1e-5
        for a, b in zip(full, part, strict=True):
            assert torch.allclose(a, b, atol=1e-6)


def test_shared_prompt_pass_matches_the_plain_pass_in_value_and_gradient():
    model, r = _rollouts(seed=2)
    idx = torch.tensor([4, 0, 5, 1])  # rows of two prompts, out of order
    results = []
    for share in (True, False):
        model.zero_grad()
        lp, _ = completion_logprobs(
            model,
            r.prompt_ids[idx],
            r.prompt_mask[idx],
            r.completion_ids[idx],
            r.completion_mask[idx],
            r.temperature[idx],
            share_prompts=share,
        )
        lp = lp * r.completion_mask[idx]
        lp.sum().backward()
        results.append((lp.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_completion_logprobs_ignores_extra_padding():
    model, r = _rollouts(seed=1)
    with torch.no_grad():
        lp, _ = completion_logprobs(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.temperature
        )
        # Two more pad columns on the left must not change anything (positions follow the mask).
        pad = torch.full((6, 2), 0)
        lp2, _ = completion_logprobs(
            model,
            torch.cat([pad, r.prompt_ids], 1),
            torch.cat([pad, r.prompt_mask], 1),
            r.completion_ids,
            r.completion_mask,
            r.temperature,
        )
    assert torch.allclose(lp * r.completion_mask, lp2 * r.completion_mask, atol=1e-5)


def test_length_buckets_minimise_tokens_plus_passes():
    lengths = torch.tensor([10, 2, 3, 9])
    # sorted 2 3 9 10; with 5 tokens a pass: [2 3] [9 10] costs 6 + 20 + 10 = 36, one bucket
    # 45, four 44, [2 3] [9] [10] 40, [2] [3] [9 10] 40
    assert [b.tolist() for b in length_buckets(lengths, 5)] == [[1, 2], [3, 0]]
    assert [b.tolist() for b in length_buckets(lengths, 100)] == [[1, 2, 3, 0]]
    assert [b.tolist() for b in length_buckets(torch.tensor([4]), 0)] == [[0]]


def test_length_buckets_give_the_one_pass_values_and_gradients():
    """Rows of lengths 8, 1, 3, 0, 6, 2 over two prompts: bucketed passes (each padded to its
    own longest row), one shared-prompt pass and the plain pass agree in log-probs, entropies
    and gradients, and all three are 0 on padding."""
    model, r = _rollouts(seed=3)
    lengths = torch.tensor([8, 1, 3, 0, 6, 2])
    mask = (torch.arange(8)[None, :] < lengths[:, None]).long()  # [6, 8]
    ids = r.completion_ids.masked_fill(mask == 0, 0)
    results, calls, lookups = [], [], []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    model.get_input_embeddings().register_forward_pre_hook(lambda *_: lookups.append(1))
    for share, pass_tokens in ((True, 0), (True, None), (False, None)):
        model.zero_grad()
        calls.clear()
        lookups.clear()
        lp, ent = completion_logprobs(
            model,
            r.prompt_ids,
            r.prompt_mask,
            ids,
            mask,
            r.temperature,
            with_entropy=True,
            entropy_grad=True,
            share_prompts=share,
            bucket_pass_tokens=pass_tokens,
        )
        assert (lp[mask == 0] == 0).all() and (ent[mask == 0] == 0).all()
        # bucketed: the prompts, then one pass per row of 2+ tokens; else 2 passes, or 1
        assert len(calls) == {(True, 0): 5, (True, None): 2, (False, None): 1}[share, pass_tokens]
        # one embedding lookup (and backward) for the prompts, one for all completion passes
        assert len(lookups) == (2 if share else 1)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    for other in results[1:]:
        torch.testing.assert_close(results[0][0], other[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results[0][1], other[1], atol=1e-5, rtol=1e-5)
        for a, b in zip(results[0][2], other[2], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_tied_embeddings_take_a_sparse_lookup_with_the_dense_lookups_gradient(monkeypatch):
    from rlvr_lightning.device import shared_prompts

    model, r = _rollouts(seed=3)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    lookups = []
    sparse = shared_prompts.sparse_lookup
    results, counts = [], []
    for use_sparse in (True, False):
        lookups.clear()
        monkeypatch.setattr(
            shared_prompts,
            "sparse_lookup",
            (lambda m, ids: lookups.append(1) or sparse(m, ids))
            if use_sparse
            else (lambda *a: None),
        )
        model.zero_grad()
        lp, _ = completion_logprobs(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.temperature
        )
        (lp * r.completion_mask).sum().backward()
        weight_grad = model.get_input_embeddings().weight.grad
        assert not weight_grad.is_sparse
        results.append([p.grad.clone() for p in model.parameters()])
        counts.append(len(lookups))
    assert counts == [2, 0]  # the prompts' and the completions' lookups; then both dense
    for a, b in zip(results[0], results[1], strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_sparse_lookup_only_for_a_plain_tied_table_under_autograd():
    from rlvr_lightning.device.shared_prompts import sparse_lookup

    model, _ = tiny_policy(seed=0)
    ids = torch.tensor([[5, 6, 7]])
    out = sparse_lookup(model, ids)
    assert out is not None and torch.equal(out, model.get_input_embeddings()(ids))
    with torch.no_grad():
        assert sparse_lookup(model, ids) is None
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda *_: None)
    assert sparse_lookup(model, ids) is None  # hooks expect the module to run
    handle.remove()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    assert sparse_lookup(model, ids) is None
