"""Builds small random Qwen3-Next checkpoints with unusual shapes and their reference outputs
from Hugging Face transformers, to check that the engine is right beyond the shared fixtures.

Run where torch + transformers are installed (the GPU host has both):
    python3 tests/reference/make_qwen3next_references.py OUT_DIR
Each case writes OUT_DIR/<case>/{config.json, model.safetensors, reference.json} where
reference.json holds the prompt, the fp32 logits of every prompt position (flattened) and 8
greedy tokens. Compare with tests/reference/compare_with_engine.sh.
"""
import json
import math
import os
import sys

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

CASES = {
    # GQA 4, DeltaNet value/key head ratio 3, a dense MLP layer, tied embeddings, no top-k
    # renormalisation, explicit layer pattern.
    "ratio3_gqa4_tied": dict(
        hidden_size=64, num_hidden_layers=6,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=3, num_experts=12, num_experts_per_tok=3,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, intermediate_size=40,
        mlp_only_layers=[2], norm_topk_prob=False, vocab_size=301, tie_word_embeddings=True,
        rope_theta=500.0, max_position_embeddings=512),
    # One key head, MQA, conv kernel 2, many experts with top-8, derived layer pattern.
    "mqa_many_experts": dict(
        hidden_size=96, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=48, partial_rotary_factor=0.25, linear_num_key_heads=1,
        linear_num_value_heads=4, linear_key_head_dim=24, linear_value_head_dim=16,
        linear_conv_kernel_dim=2, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, norm_topk_prob=True, vocab_size=512,
        tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=512),
}


# One-factor variations of the first case, to localise a disagreement.
_BASE = CASES["ratio3_gqa4_tied"]
VARIANTS = {
    "a_ratio2": dict(_BASE, linear_num_value_heads=4),
    "a_kernel4": dict(_BASE, linear_conv_kernel_dim=4),
    "a_gqa2": dict(_BASE, num_key_value_heads=4),
    "a_rope025": dict(_BASE, partial_rotary_factor=0.25),
    "a_renorm": dict(_BASE, norm_topk_prob=True),
    "a_untied": dict(_BASE, tie_word_embeddings=False),
    "a_nodense": dict(_BASE, mlp_only_layers=[]),
    "a_allattn": dict(_BASE, layer_types=["full_attention"] * 6),
    "a_alllinear": dict(_BASE, layer_types=["linear_attention"] * 6),
}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "linear_attn.norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))


def main(out_dir, which="cases"):
    cases = CASES if which == "cases" else VARIANTS
    for i, (name, kwargs) in enumerate(cases.items()):
        config = Qwen3NextConfig(**kwargs)
        torch.manual_seed(i)
        model = Qwen3NextForCausalLM(config)
        randomize(model, 100 + i)
        model = model.to(torch.bfloat16)
        case_dir = os.path.join(out_dir, name)
        model.save_pretrained(case_dir)
        if "layer_types" not in kwargs:  # make the engine derive the pattern
            with open(os.path.join(case_dir, "config.json")) as f:
                cfg = json.load(f)
            cfg.pop("layer_types", None)
            with open(os.path.join(case_dir, "config.json"), "w") as f:
                json.dump(cfg, f, indent=1)
        # Reload from the saved bf16 checkpoint in fp32, as a user would: calling .float() on
        # the bf16 model instead would keep the rotary inv_freq buffer rounded to bf16, which
        # is not what the checkpoint means (angles drift by ~0.2% per position).
        model = Qwen3NextForCausalLM.from_pretrained(case_dir, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(7 + i)
        prompt = torch.randint(0, config.vocab_size, (1, 37), generator=g)
        with torch.no_grad():
            logits = model(prompt).logits[0].float()
            gen = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True)
        ref = {"prompt": prompt[0].tolist(), "vocab": config.vocab_size,
               "logits": logits.flatten().tolist(), "greedy": gen[0, 37:].tolist()}
        with open(os.path.join(case_dir, "reference.json"), "w") as f:
            json.dump(ref, f)
        for extra in os.listdir(case_dir):
            if extra not in ("config.json", "model.safetensors", "reference.json"):
                os.remove(os.path.join(case_dir, extra))
        print(name, "written", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cases")
