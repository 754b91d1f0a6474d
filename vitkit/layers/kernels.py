"""What the kernels of this machine can do, for the attention core to choose its path: native bf16 matmuls
and AMX tiles on the CPU, the rule ``attn_backend="auto"`` follows in a traced graph (eager calls are timed,
``autotune``), and whether torch.compile can build flex attention here; flex attention compiled once per process;
the warnings logged once when the core runs ``sdpa`` in place of ``flex``. No attention is computed here."""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch
from torch import Tensor

log = logging.getLogger(__name__)


@functools.cache
def _detect_bf16_matmul() -> bool:
    # torch.cpu has no public query for these (checked on torch 2.14.1; tests/layers/test_attention.py fails
    # if they disappear)
    cpu = torch.cpu
    native = getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(cpu, "_is_amx_tile_supported", lambda: False)()
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in (
        "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
    return native and not capped


@torch.compiler.assume_constant_result  # a fact of the machine: torch.compile takes it as a constant
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX) and oneDNN may use it
    (``ONEDNN_MAX_CPU_ISA`` can cap it below that); without it bf16 GEMMs are emulated and slow."""
    return _detect_bf16_matmul()


@functools.cache
def _detect_amx() -> bool:
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() not in (
        "ALL", "DEFAULT", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16")
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()) and not capped


@torch.compiler.assume_constant_result  # a fact of the machine, as cpu_has_bf16_matmul
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon since Sapphire Rapids) and oneDNN may use them
    (``ONEDNN_MAX_CPU_ISA`` can cap it below that)."""
    return _detect_amx()


@functools.cache
def cpu_has_int8_dot() -> bool:
    """Whether this CPU has an int8 dot product that cannot saturate (AVX512-VNNI or AMX) and oneDNN may use it. On
    AVX2 alone oneDNN's u8·s8 products add pairs in 16 bits (vpmaddubsw), which saturate for full-range weights and
    activations: int8 kernels there give other numbers than the quantized model."""
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in ("SSE41", "AVX", "AVX2", "AVX512_CORE")
    return bool(torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()) and not capped


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (the first compile is slow on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    # One compiled function serves every layer shape and mask kind of the process (Swin alone has
    # several); past dynamo's default of 8 variants it would silently run the unfused fallback.
    # torch._dynamo.config has no public equivalent (checked on torch 2.14.1; tests/layers/test_attention.py
    # fails if the setting disappears).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def flex_runs_on_cpu() -> bool:
    """Whether torch.compile can build flex attention for this CPU: it needs AVX2 or better (the kernels
    ATen dispatches to, which ``ATEN_CPU_CAPABILITY`` may lower) and is not built on macOS."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX") and sys.platform != "darwin"


@functools.cache
def _warn_flex_fallback() -> None:
    log.warning("attn_backend='flex' has no backward on CPU; using 'sdpa' for forwards that need gradients")


@functools.cache
def _warn_flex_unsupported() -> None:
    log.warning("attn_backend='flex' cannot be compiled for this CPU (it needs AVX2; capability %s); using 'sdpa'",
                torch.backends.cpu.get_cpu_capability())


def static_backend(q: Tensor, learned_bias: bool = False) -> str:
    """What ``auto`` runs for queries ``q`` where nothing can be timed (a graph being traced or compiled; eager calls
    are timed, ``autotune``): the path measured faster on the CPUs at hand for their dtype and grad mode, the first
    row that applies (2 cores, PyTorch 2.14.1; benchmarks/README.md)::

        bf16 emulated (no AVX512-BF16 or AMX: AVX2 only)                 sdpa: 5-20x the explicit bf16 matmuls
        a bias that needs its gradient (Swin's tables in training)       math: SDPA runs its own slower path for it
        bf16, native bf16 matmuls (AVX512-BF16 / AMX), with gradients    math: forward + backward 2-2.5x the kernel's
        bf16, AVX512-BF16 without AMX, inference                         math: forward 1.3-1.8x the kernel's
        bf16, AMX, inference                                             sdpa: the kernel is faster there
        float32, float16                                                 sdpa
    """
    if q.device.type != "cpu":
        return "sdpa"
    native_bf16 = q.dtype == torch.bfloat16 and cpu_has_bf16_matmul()
    if q.dtype == torch.bfloat16 and not native_bf16:
        return "sdpa"  # emulated bf16 matmuls: the kernel works in float32 inside, and is the faster one
    if learned_bias:
        return "math"
    if native_bf16:
        if torch.is_grad_enabled() and q.requires_grad:
            return "math"
        return "sdpa" if cpu_has_amx() else "math"
    return "sdpa"
