"""In-process tiny models and a byte-level tokenizer for tests and smoke runs.

Nothing here touches the network: the tokenizer is built from the 256 byte values plus a few
special tokens, and the model is a randomly initialised Llama of a few thousand parameters.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr_lightning.rewards.trl_contract import Completion, completion_text

SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (vocab 259) with a ChatML template; EOS is ``<|im_end|>``."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tiny_policy(
    seed: int = 0, hidden: int = 32, layers: int = 2
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A random tiny Llama and the byte tokenizer; same seed, same weights."""
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def digit_fraction(completions: list[Completion], **_: object) -> list[float]:
    """A dense toy reward: the fraction of characters that are digits.

    Random tiny models almost never earn a verifiable reward, so their groups would have zero
    variance and nothing to learn; this reward varies between samples and makes updates happen.
    """
    texts = [completion_text(c) for c in completions]  # message lists on chat prompts
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in texts]


def tiny_module(**overrides: object):
    """An ``RLVRModule`` on ``tiny:0`` with the ``digit_fraction`` reward, 8 new tokens at
    temperature 1 in groups of 4, micro-batches of 8 and lr 1e-3; ``overrides`` replace any
    argument."""
    from rlvr_lightning import RLVRModule
    from rlvr_lightning.types import Sampling

    kwargs: dict[str, object] = {
        "reward_fns": [digit_fraction],
        "sampling": Sampling(max_new_tokens=8, temperature=1.0, group_size=4),
        "micro_batch_size": 8,
        "lr": 1e-3,
    }
    return RLVRModule("tiny:0", **{**kwargs, **overrides})


def quiet_trainer(**overrides: object) -> pl.Trainer:
    """A CPU ``Trainer`` for tests and benchmarks: no logger, checkpoints, progress bar, model
    summary or validation unless ``overrides`` turn them on."""
    kwargs: dict[str, object] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**kwargs, **overrides})


def checkpointing_args(root: object) -> list[str]:
    """CLI arguments that save ``last.ckpt`` under ``<root>/ckpt`` and log under ``root``."""
    return [
        "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root}/ckpt",
        "--trainer.callbacks.save_last=true",
        f"--trainer.default_root_dir={root}",
    ]


def ppo_update(**overrides):
    """A ``PolicyUpdate`` with PPO clip loss, clip 0.2, seq-mean-token-mean over 8 tokens, no KL
    and no entropy bonus, micro-batches of 4; ``overrides`` replace any field."""
    from rlvr_lightning.losses import ppo_clip_loss
    from rlvr_lightning.update import PolicyUpdate

    fields = dict(
        loss_fn=ppo_clip_loss,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        agg_mode="seq-mean-token-mean",
        norm_len=8,
        kl_coef=0.0,
        kl_estimator="k3",
        entropy_coef=0.0,
        micro_batch_size=4,
    )
    return PolicyUpdate(**{**fields, **overrides})
