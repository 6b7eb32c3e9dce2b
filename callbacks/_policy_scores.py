"""How the current policy rates guidance candidates for one prompt, before any is injected.

``MixedPolicyGuidance`` uses them to pick among several candidates: ExGRPO's lowest mean token
entropy over stored trajectories, AMPO's comprehension score over teacher responses. Each runs
one no-grad forward of the policy over the candidates as completions of the row's prompt.
"""

from __future__ import annotations

import torch

from rlvr_lightning.algorithms.ops import masked_mean
from rlvr_lightning.device import completion_logprobs
from rlvr_lightning.guidance.experience import Trajectory
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.rewards.math import extract_boxed
from rlvr_lightning.stages.offpolicy import encode
from rlvr_lightning.types import Rollouts


def answer_prefix(response: str) -> str:
    r"""The response up to the content of its last ``\boxed{``, or the response followed by
    ``\boxed{`` when it has none: the context in which the ground-truth answer is scored."""
    content = extract_boxed(response)
    if content is None:
        return f"{response.rstrip()} \\boxed{{"
    start = response.rfind(content + "}")
    return response[:start]


def policy_pass(
    module: RLVRModule, rollouts: Rollouts, row: int, seqs: list[list[int]], temps: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs, entropies and mask ``[c, T]`` of completions ``seqs`` of ``row``'s prompt."""
    device = rollouts.completion_ids.device
    width = max(len(s) for s in seqs)
    pad = module.tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)  # [c, T]
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    c = len(seqs)
    with torch.no_grad():
        logp, entropy = completion_logprobs(
            module.policy,
            rollouts.prompt_ids[row].expand(c, -1),
            rollouts.prompt_mask[row].expand(c, -1),
            ids,
            mask,
            torch.tensor(temps, device=device, dtype=torch.float32),
            with_entropy=True,
            head_chunk_tokens=module.updater.head_chunk_tokens,
        )
    return logp, entropy, mask


def lowest_entropy(
    module: RLVRModule, rollouts: Rollouts, row: int, trajs: list[Trajectory]
) -> int:
    """ExGRPO's selection: the index of the trajectory with the lowest mean token entropy now."""
    if len(trajs) == 1:
        return 0
    _, entropy, mask = policy_pass(
        module, rollouts, row, [t.token_ids for t in trajs], [t.temperature for t in trajs]
    )
    return int(masked_mean(entropy, mask, dim=-1).argmin())


def comprehension(
    module: RLVRModule, rollouts: Rollouts, row: int, responses: list[str], answer: str
) -> torch.Tensor:
    """AMPO's score ``[c]``: mean probability of the ground-truth answer's tokens after each
    teacher's reasoning (its own final answer replaced by the ground truth)."""
    tok = module.tokenizer
    answer_ids = tok(answer, add_special_tokens=False).input_ids
    prefixes = [encode(tok, answer_prefix(r), tok.eos_token_id)[:-1] for r in responses]
    seqs = [p + answer_ids for p in prefixes]
    logp, _, _ = policy_pass(module, rollouts, row, seqs, [1.0] * len(seqs))
    scores = [
        logp[i, len(p) : len(p) + len(answer_ids)].exp().mean() for i, p in enumerate(prefixes)
    ]
    return torch.stack(scores).cpu()
