"""Training precision by machine: where bf16 is fast, and what ``training.mixed_precision: auto`` means.

CPUs differ more than GPUs here. With AVX512-BF16 or AMX, oneDNN computes bf16
matmuls natively and a bf16 SFT step is about 1.8x faster than fp32. Without
them (AVX2-only CPUs) bf16 is emulated: a 2-core AMD EPYC ran the same SFT step
25x slower than fp32 (9.6 against 237 positions/s). So ``auto`` picks bf16 on a CPU
only where the CPU has native bf16, and an explicit ``bf16`` there warns with the
slowdown measured on this machine (DESIGN.md section 9).

Detection, in order:

1. ``$SPECFORGE_OPD_CPU_BF16`` = ``native`` or ``emulated`` forces the answer (for
   tests, and for a CPU whose flags mislead);
2. the CPU flags in ``/proc/cpuinfo``: ``avx512_bf16`` or ``amx_bf16`` (x86), ``bf16``
   (aarch64), unless ``$ONEDNN_MAX_CPU_ISA`` caps oneDNN below those instructions;
3. where no flags can be read (not Linux), a timed probe: a bf16 matmul of
   lm_head shape against the same in fp32, run once and cached in the asset cache.

Nothing here prints, except ``announce``.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

from specforge_opd.atomic import atomic_write_json
from specforge_opd.data.locations import cache_dir
from specforge_opd.models import target

#: Forces the CPU bf16 answer: "native" or "emulated" (anything else: detect).
BF16_ENV = "SPECFORGE_OPD_CPU_BF16"
#: x86 flags with which oneDNN runs bf16 matmuls natively; aarch64's is ``bf16``.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
#: ``ONEDNN_MAX_CPU_ISA`` values that still allow native bf16 (oneDNN's ISA names).
_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
              "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
              "ALL", "DEFAULT")
#: The probe's matmul: [rows, hidden] @ [hidden, vocab slice], the embedded target's lm_head shape.
_PROBE_SHAPE = (64, 576, 4096)
_PROBE_FILE = "cpu_bf16_probe.json"

Value = Literal["bf16", "fp32", "fp16"]
_TORCH_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
_CONFIG_NAMES = {v: k for k, v in _TORCH_NAMES.items()}


def _cpuinfo() -> dict[str, str]:
    """The first processor block of ``/proc/cpuinfo`` as {key: value}; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        k, _, v = line.partition(":")
        out.setdefault(k.strip(), v.strip())
    return out


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), or ``"unknown"``."""
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or "unknown"


def cpu_flags() -> Optional[set[str]]:
    """The CPU's feature flags (x86 ``flags``, aarch64 ``Features``); None where they cannot be read."""
    info = _cpuinfo()
    flags = info.get("flags") or info.get("Features")
    return set(flags.split()) if flags is not None else None


def _isa_cap_allows_bf16() -> bool:
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return not cap or cap in _BF16_ISAS


def _probe_path() -> Path:
    return cache_dir() / _PROBE_FILE


def _probe_key(threads: int) -> str:
    import torch

    return f"{cpu_model()}|torch {torch.__version__}|threads {threads}|isa {os.environ.get('ONEDNN_MAX_CPU_ISA', '')}"


def bf16_slowdown(threads: Optional[int] = None, *, refresh: bool = False) -> float:
    """Measured time of a bf16 matmul over the same matmul in fp32 on this CPU (> 1: bf16 is slower).

    The matmul is [64, 576] @ [576, 4096] (the embedded target's lm_head shape), best of 3
    after a warm-up, at ``threads`` (default: torch's current count). The result is cached
    in the asset cache (``cpu_bf16_probe.json``) per CPU model, torch version, thread count
    and oneDNN ISA cap, so each machine pays for it once (about 0.1 s with native bf16,
    up to 1.5 s on an AVX2-only CPU).
    """
    import torch

    n = int(threads or torch.get_num_threads())
    key = _probe_key(n)
    path = _probe_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if not refresh and isinstance(cached.get(key), (int, float)):
        return float(cached[key])
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        m, k, v = _PROBE_SHAPE
        times = {}
        for dt in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            a, b = torch.randn(m, k, generator=g).to(dt), torch.randn(k, v, generator=g).to(dt)
            a @ b
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t0)
            times[dt] = best
    finally:
        torch.set_num_threads(before)
    ratio = times[torch.bfloat16] / max(times[torch.float32], 1e-9)
    cached[key] = ratio
    try:
        atomic_write_json(path, cached)
    except OSError:
        pass  # a read-only cache costs a re-measure next time, nothing else
    return ratio


@functools.lru_cache(maxsize=None)
def _detect(forced: str, isa_cap: str) -> tuple[bool, str]:
    del isa_cap  # part of the cache key only
    if forced in ("native", "emulated"):
        return forced == "native", f"${BF16_ENV}={forced}"
    flags = cpu_flags()
    if flags is not None:
        have = sorted(f for f in NATIVE_BF16_FLAGS if f in flags)
        if have and not _isa_cap_allows_bf16():
            return False, f"CPU flags {', '.join(have)}, but ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} disables them"
        if have:
            return True, f"CPU flags {', '.join(have)}"
        return False, "no avx512_bf16/amx_bf16 CPU flag"
    ratio = bf16_slowdown()
    return ratio <= 1.0, f"timed probe: bf16 matmul {ratio:.2f}x the fp32 time"


def cpu_bf16_native() -> tuple[bool, str]:
    """(whether this CPU computes bf16 matmuls natively, why we think so). See the module docstring."""
    return _detect(os.environ.get(BF16_ENV, "").strip().lower(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""))


def machine_info() -> dict:
    """What a benchmark or run record needs to say about the machine it ran on.

    Returns ``{"cpu_model", "cpu_capability" (torch.backends.cpu.get_cpu_capability()),
    "cpu_bf16_native", "cpu_bf16_reason", "cores", "threads" (torch intra-op), "torch",
    "platform", "cuda_device" (name, or None)}``.
    """
    import torch

    native, why = cpu_bf16_native()
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16_native": native, "cpu_bf16_reason": why, "cores": target.usable_cores(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "platform": f"{platform.system()} {platform.machine()}", "cuda_device": cuda}


def uses_cuda(device: str) -> bool:
    """Whether a ``target.device`` value puts the work on a GPU: ``cuda*``, or ``auto`` with CUDA available."""
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class Precision:
    """A resolved ``training.mixed_precision``.

    Attributes:
        requested: the config value, ``auto``, ``fp32`` or ``bf16``.
        value: what runs: ``bf16``, ``fp32`` or ``fp16`` (SFT on a GPU with a float16 target).
        device: ``cpu`` or ``cuda``.
        reason: why ``value`` (the rule that chose it), one line.
        cpu_bf16_native: on a CPU, whether bf16 is native there; None on a GPU.
        warn: an explicit bf16 on a CPU without native bf16 (``announce`` warns).
    """

    requested: str
    value: Value
    device: str
    reason: str
    cpu_bf16_native: Optional[bool]
    warn: bool = False

    @property
    def dtype(self) -> str:
        """The torch dtype name of ``value``: ``bfloat16``, ``float32`` or ``float16``."""
        return _TORCH_NAMES[self.value]

    def record(self) -> dict:
        """A JSON-ready record of the choice, for run records, exports and benchmark results."""
        return asdict(self)


def _cpu_choice(requested: str, device: str) -> Precision:
    native, why = cpu_bf16_native()
    if requested == "auto":
        value: Value = "bf16" if native else "fp32"
        return Precision(requested, value, device, f"auto on a CPU {'with' if native else 'without'} native bf16: {why}", native)
    return Precision(requested, requested, device, "set explicitly", native, warn=requested == "bf16" and not native)  # type: ignore[arg-type]


def resolve_sft(requested: str, target_dtype: str, device: str) -> Precision:
    """``training.mixed_precision`` for the SFT stage: SpecForge's drafter ``torch_dtype`` and the features' dtype.

    ``fp32``/``bf16`` as given. ``auto``: on a GPU the target's dtype (``target.dtype``);
    on a CPU bf16 where the CPU has native bf16, fp32 otherwise (``cpu_bf16_native``).

    Args:
        requested: ``auto``, ``fp32`` or ``bf16``.
        target_dtype: ``target.dtype`` (``float32``, ``bfloat16`` or ``float16``).
        device: ``target.device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``).

    Raises:
        ValueError: an unknown ``requested`` or ``target_dtype``.
    """
    if requested not in ("auto", "fp32", "bf16"):
        raise ValueError(f"training.mixed_precision={requested!r}: use auto, fp32 or bf16")
    if uses_cuda(device):
        if requested != "auto":
            return Precision(requested, requested, "cuda", "set explicitly", None)  # type: ignore[arg-type]
        if target_dtype not in _CONFIG_NAMES:
            raise ValueError(f"target.dtype={target_dtype!r}: use float32, bfloat16 or float16")
        return Precision(requested, _CONFIG_NAMES[target_dtype], "cuda", f"auto on a GPU: target.dtype {target_dtype}", None)
    return _cpu_choice(requested, "cpu")


def resolve_trainer(requested: str, device_type: str) -> Precision:
    """``training.mixed_precision`` for the OPD trainer (FSDP2's compute dtype; fp32 master weights always).

    ``fp32``/``bf16`` as given. ``auto``: bf16 on a GPU, fp32 on a CPU whatever the CPU: the
    trainer's CPU path exists for exact fp32 (its replay, resume and 2-rank tests compare
    fp32 results), and its cost on the embedded target is the rollout's, not the trainer's.

    Raises:
        ValueError: an unknown ``requested``.
    """
    if requested not in ("auto", "fp32", "bf16"):
        raise ValueError(f"training.mixed_precision={requested!r}: use auto, fp32 or bf16")
    if device_type == "cuda":
        reason = "set explicitly" if requested != "auto" else "auto on a GPU: bf16 compute, fp32 master weights"
        return Precision(requested, "bf16" if requested == "auto" else requested, "cuda", reason, None)  # type: ignore[arg-type]
    if requested == "auto":
        native, _ = cpu_bf16_native()
        return Precision(requested, "fp32", "cpu", "auto on a CPU: the OPD trainer computes in exact fp32", native)
    return _cpu_choice(requested, "cpu")


def announce(p: Precision, where: str, *, file=None) -> None:
    """Print the choice on one line; for a bf16 choice on a CPU without native bf16, one warning line more.

    The warning runs the timed probe (``bf16_slowdown``, cached) to name the slowdown on this machine.
    """
    out = file or sys.stdout
    print(f"[{where}] training.mixed_precision={p.requested} -> {p.value} on {p.device} ({p.reason})", file=out, flush=True)
    if p.warn:
        ratio = bf16_slowdown()
        print(f"[{where}] warning: this CPU has no native bf16 ({cpu_bf16_native()[1]}); a bf16 matmul measured "
              f"{ratio:.1f}x slower than fp32 here; training.mixed_precision=auto picks fp32 on such a CPU",
              file=sys.stderr, flush=True)
