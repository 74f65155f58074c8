"""How far Hugging Face's own bf16 forward lands from the fp32 reference logits of a fixture:
the yardstick for our CUDA backend's bf16 error (same metric: max|a-b| / max|b|).

    python3 tests/reference/hf_bf16_baseline.py FIXTURE_DIR   (needs torch, transformers, a GPU)
"""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main(d):
    ref = json.load(open(f"{d}/reference.json"))
    logits_ref = load_file(f"{d}/reference_logits.safetensors")
    for device in ["cuda", "cpu"]:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(device).eval()
        for i, prompt in enumerate(ref["prompts"]):
            with torch.no_grad():
                out = model(torch.tensor([prompt], device=device)).logits[0].float().cpu()
            want = logits_ref[f"logits_{i}"]
            err = (out - want).abs().max() / want.abs().max()
            agree = (out.argmax(-1) == want.argmax(-1)).float().mean()
            print(f"{d.rstrip('/').split('/')[-1]} {device} prompt {i} (len {len(prompt)}): "
                  f"bf16 rel err {err:.2e}, argmax agreement {agree:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
