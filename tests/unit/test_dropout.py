"""``disable_dropout`` zeroes every dropout rate: modules, attention attributes, configs."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlvr_lightning.models.dropout import disable_dropout, is_dropout_name


def test_dropout_names():
    for name in ["attention_dropout", "hidden_dropout_prob", "attn_pdrop", "resid_pdrop"]:
        assert is_dropout_name(name), name
    for name in ["hidden_size", "dropped", "rms_norm_eps"]:
        assert not is_dropout_name(name), name


def test_llama_attention_dropout_is_zeroed_and_train_mode_is_deterministic():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        attention_dropout=0.5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 7))  # [B, T]
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout draws differ
    # One config-level rate (attention_dropout), one attribute copy per attention layer.
    assert disable_dropout(model) == 3
    assert model.config.attention_dropout == 0.0
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in model.model.layers)
    assert torch.equal(model(ids).logits, model(ids).logits)
    assert disable_dropout(model) == 0  # nothing left
