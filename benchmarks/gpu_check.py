"""GPU checks for the fused path (run by gpu_check.sh on a machine with one CUDA GPU; never in CI).

1. The backends agree in bf16 on the GPU (ViT, Swin with bias + shift mask, the encoder-decoder).
2. Which SDPA kernel actually ran (flash / cuDNN / memory-efficient / math) for ViT and for Swin with its
   bias, read from the profiler's kernel names, and that flex compiled and ran.
Exits non-zero if a check fails; prints one line per finding.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import vitkit

KERNELS = {"flash": ("flash",), "cudnn": ("cudnn",), "efficient": ("efficient", "mem_eff", "fmha"),
           "math": ("softmax",)}


def kernels_run(model, x) -> set[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        model(x)
        torch.cuda.synchronize()
    names = " ".join(e.key.lower() for e in prof.key_averages())
    return {k for k, pats in KERNELS.items() if any(p in names for p in pats)}


def main() -> int:
    assert torch.cuda.is_available(), "gpu_check needs a CUDA GPU"
    dev, failures = "cuda", []
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    torch.manual_seed(0)
    for name, size in (("vit_base_patch16_224", 224), ("swin_tiny_patch4_window7_224", 224)):
        m = vitkit.create_model(name).to(dev).eval()
        x = torch.randn(8, 3, size, size, device=dev)
        outs = {}
        for backend in ("math", "sdpa", "flex"):
            m.set_attn_backend(backend)
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                outs[backend] = m(x).float()
        for backend in ("sdpa", "flex"):
            err = (outs[backend] - outs["math"]).abs().max().item()
            ok = err < 0.1  # bf16 logits of a random-weight model, |logit| ~ 1
            print(f"{name}: {backend} vs math max |diff| {err:.4f} in bf16 {'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append(f"{name} {backend}")
        m.set_attn_backend("sdpa")
        print(f"{name}: sdpa kernels that ran: {sorted(kernels_run(m, x)) or ['none found']}")
        m.set_attn_backend("flex")
        print(f"{name}: flex kernels that ran: {sorted(kernels_run(m, x)) or ['compiled triton kernels']}")
    s2s = vitkit.create_model("transformer_tiny", src_vocab_size=100, tgt_vocab_size=100).to(dev).eval()
    src = torch.randint(3, 100, (4, 16), device=dev)
    a, b = s2s.generate(src, max_len=32), s2s.generate(src, max_len=32, use_cache=False)
    print(f"transformer_tiny: cached == uncached decoding on GPU: {bool(torch.equal(a, b))}")
    if not torch.equal(a, b):
        failures.append("seq2seq cache")
    print("FAILED: " + ", ".join(failures) if failures else "all GPU checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
