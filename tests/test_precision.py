"""training.mixed_precision by machine: auto picks bf16 on a CPU only where bf16 is native, an explicit value
wins, a bf16 choice on an emulating CPU warns with the measured slowdown, and the choice reaches the keys and records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from specforge_opd import precision
from specforge_opd.stages import sft_features, sft_train
from tests.sft_helpers import tiny_cfg

ROOT = Path(__file__).resolve().parents[1]

SAPPHIRE = {"model name": "Intel(R) Xeon(R) Platinum 8480+",
            "flags": "fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile"}
EPYC = {"model name": "AMD EPYC 7B13", "flags": "fpu sse avx2 fma"}
GRAVITON3 = {"model name": "", "Features": "fp asimd bf16 sve"}


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to run on the CPU whose /proc/cpuinfo block is given; detection uncached, no override."""
    monkeypatch.delenv(precision.BF16_ENV, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def use(info):
        monkeypatch.setattr(precision, "_cpuinfo", lambda: dict(info))
        precision._detect.cache_clear()

    yield use
    precision._detect.cache_clear()


def test_native_bf16_from_the_cpu_flags(cpu, monkeypatch):
    cpu(SAPPHIRE)
    native, why = precision.cpu_bf16_native()
    assert native and "amx_bf16" in why and "avx512_bf16" in why
    cpu(GRAVITON3)
    assert precision.cpu_bf16_native()[0]
    cpu(EPYC)
    native, why = precision.cpu_bf16_native()
    assert not native and "no avx512_bf16/amx_bf16" in why
    # oneDNN capped below its bf16 instructions computes bf16 the slow way, flags or not
    cpu(SAPPHIRE)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    native, why = precision.cpu_bf16_native()
    assert not native and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core_amx")
    assert precision.cpu_bf16_native()[0]


def test_the_environment_override_wins_over_the_flags(cpu, monkeypatch):
    cpu(SAPPHIRE)
    monkeypatch.setenv(precision.BF16_ENV, "emulated")
    assert precision.cpu_bf16_native() == (False, f"${precision.BF16_ENV}=emulated")
    cpu(EPYC)
    monkeypatch.setenv(precision.BF16_ENV, "native")
    assert precision.cpu_bf16_native()[0]


def test_without_flags_the_timed_probe_decides(cpu, monkeypatch):
    cpu({})  # no /proc/cpuinfo (macOS, say)
    monkeypatch.setattr(precision, "bf16_slowdown", lambda *a, **k: 8.0)
    native, why = precision.cpu_bf16_native()
    assert not native and "8.00x" in why
    cpu({})
    monkeypatch.setattr(precision, "bf16_slowdown", lambda *a, **k: 0.5)
    assert precision.cpu_bf16_native()[0]


def test_the_probe_measures_once_per_machine_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_OPD_CACHE", str(tmp_path))
    monkeypatch.setattr(precision, "_PROBE_SHAPE", (8, 64, 256))  # emulated bf16 is slow: keep the test short
    ratio = precision.bf16_slowdown(1)
    assert ratio > 0
    cached = json.loads((tmp_path / "cpu_bf16_probe.json").read_text())
    assert list(cached.values()) == [ratio] and "threads 1" in next(iter(cached))
    # a second call reads the cache: a planted value comes back unchanged
    cached[next(iter(cached))] = 123.0
    (tmp_path / "cpu_bf16_probe.json").write_text(json.dumps(cached))
    assert precision.bf16_slowdown(1) == 123.0
    assert precision.bf16_slowdown(1, refresh=True) != 123.0
    # a damaged cache file is measured again, not an error
    (tmp_path / "cpu_bf16_probe.json").write_text("{not json")
    assert precision.bf16_slowdown(1) > 0


def test_sft_auto_is_bf16_only_on_a_cpu_with_native_bf16(cpu):
    cpu(SAPPHIRE)
    p = precision.resolve_sft("auto", "float32", "cpu")
    assert (p.value, p.dtype, p.device, p.warn, p.cpu_bf16_native) == ("bf16", "bfloat16", "cpu", False, True)
    cpu(EPYC)
    p = precision.resolve_sft("auto", "float32", "cpu")
    assert (p.value, p.dtype, p.warn, p.cpu_bf16_native) == ("fp32", "float32", False, False)
    assert "without native bf16" in p.reason
    # an explicit value wins; bf16 on an emulating CPU is kept, with a warning to come
    p = precision.resolve_sft("bf16", "float32", "cpu")
    assert (p.value, p.warn) == ("bf16", True)
    cpu(SAPPHIRE)
    assert precision.resolve_sft("fp32", "float32", "cpu").value == "fp32"
    with pytest.raises(ValueError, match="training.mixed_precision"):
        precision.resolve_sft("fp8", "float32", "cpu")


def test_sft_auto_on_a_gpu_keeps_the_target_dtype(cpu):
    cpu(EPYC)  # the host CPU does not matter on a GPU
    for target_dtype, value in (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")):
        p = precision.resolve_sft("auto", target_dtype, "cuda:0")
        assert (p.value, p.dtype, p.device, p.cpu_bf16_native, p.warn) == (value, target_dtype, "cuda", None, False)
    assert precision.resolve_sft("fp32", "bfloat16", "cuda").value == "fp32"


def test_opd_trainer_auto_is_fp32_on_any_cpu_and_bf16_on_a_gpu(cpu):
    cpu(SAPPHIRE)
    assert precision.resolve_trainer("auto", "cpu").value == "fp32"
    assert precision.resolve_trainer("auto", "cuda").value == "bf16"
    assert precision.resolve_trainer("bf16", "cpu").warn is False
    cpu(EPYC)
    assert precision.resolve_trainer("bf16", "cpu").warn is True
    assert precision.resolve_trainer("fp32", "cuda").value == "fp32"


def test_announce_prints_the_choice_and_one_warning_line_with_the_measured_slowdown(cpu, monkeypatch, capsys):
    cpu(EPYC)
    monkeypatch.setattr(precision, "bf16_slowdown", lambda *a, **k: 24.6)
    precision.announce(precision.resolve_sft("auto", "float32", "cpu"), "sft")
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and "training.mixed_precision=auto -> fp32 on cpu" in out and err == ""
    precision.announce(precision.resolve_sft("bf16", "float32", "cpu"), "sft")
    out, err = capsys.readouterr()
    assert "training.mixed_precision=bf16 -> bf16" in out
    assert err.count("\n") == 1 and "warning" in err and "24.6x slower than fp32" in err


def test_the_sft_keys_hold_the_resolved_precision(cpu, tmp_path):
    """auto trains bf16 on one CPU and fp32 on another: the features and train keys say which, so a run moved
    between such machines does not resume the other's features or checkpoints."""
    auto = tiny_cfg(tmp_path, **{"training.mixed_precision": "auto", "target.device": "cpu"})
    cpu(SAPPHIRE)
    assert sft_features.drafter_dtype(auto) == "bfloat16"
    native_key = sft_train.sft_training_inputs(auto)
    assert native_key == sft_train.sft_training_inputs(tiny_cfg(tmp_path, **{"training.mixed_precision": "bf16",
                                                                             "target.device": "cpu"}))
    cpu(EPYC)
    assert sft_features.drafter_dtype(auto) == "float32"
    assert sft_train.sft_training_inputs(auto) != native_key
    assert sft_train.sft_training_inputs(auto) == sft_train.sft_training_inputs(tiny_cfg(tmp_path, **{"target.device": "cpu"}))
    run = sft_train.specforge_run_config(auto, target_path="t", draft_config_file=tmp_path / "c.json", features=tmp_path,
                                         out_dir=tmp_path / "o", num_samples=8, mask_token_id=5, gpus=0)
    assert run["model"]["torch_dtype"] == "float32"


def test_the_embedded_sft_configs_leave_precision_to_the_machine():
    """configs/tiny and configs/small train bf16 only where it is fast: an explicit bf16 there made SFT 25x
    slower than fp32 on an AVX2-only CPU (and the suite overran CI)."""
    for path in [ROOT / "configs" / "tiny" / "sft.yaml", *sorted((ROOT / "configs" / "small").glob("sft*.yaml"))]:
        raw = yaml.safe_load(path.read_text())
        assert raw["training"]["mixed_precision"] == "auto", path.name


def test_machine_info_names_the_cpu_and_its_bf16():
    info = precision.machine_info()
    assert {"cpu_model", "cpu_capability", "cpu_bf16_native", "cpu_bf16_reason", "threads", "cores", "torch"} <= set(info)
    assert isinstance(info["cpu_bf16_native"], bool) and info["threads"] >= 1


def test_a_dry_run_plans_the_precision_of_the_device_it_plans_for(cpu, tmp_path):
    """A laptop's --dry-run of a cluster config (target.device auto) plans the GPU run: features in target.dtype;
    a CPU config (target.device cpu) plans this CPU's choice."""
    from specforge_opd.models.drafter import derive_draft_config
    from specforge_opd.stages.plan import estimate_sft
    from tests.conftest import make_tiny_target

    tconf = make_tiny_target().config
    dconf = derive_draft_config(tconf, num_hidden_layers=1, block_size=4, mask_token_id=96)
    cpu(EPYC)
    gpu_plan = estimate_sft(tiny_cfg(tmp_path, **{"training.mixed_precision": "auto", "target.dtype": "bfloat16",
                                                  "target.device": "auto"}), tconf, dconf, 4)
    cpu_plan = estimate_sft(tiny_cfg(tmp_path, **{"training.mixed_precision": "auto", "target.dtype": "bfloat16",
                                                  "target.device": "cpu"}), tconf, dconf, 4)
    assert gpu_plan["precision"]["value"] == "bf16" and gpu_plan["precision"]["device"] == "cuda"
    assert cpu_plan["precision"]["value"] == "fp32"
    assert cpu_plan["feature_bytes_per_sample_max"] > gpu_plan["feature_bytes_per_sample_max"]
