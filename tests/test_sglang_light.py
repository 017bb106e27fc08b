"""SGLang 0.5.23's own code, on a CPU: its argument pipeline on the launcher's flags, its plugin loader and
HookRegistry on our plugin (``specforge_opd.sglang.light``: the pinned wheel without dependencies plus three
small packages, cached; about 10 s). Skipped when the environment cannot be fetched (offline).

What a light environment cannot import is named in ``light.NEEDS_CUDA`` (and docs/sglang.md): the hook
targets' modules, so applying our hooks to SGLang's real classes is checked by reading the wheel's source
(tests/test_sglang_contract.py) and by scripts/gpu_check_sglang_native.sh.
"""

from __future__ import annotations

import pytest

from specforge_opd.config import SGLangConfig
from specforge_opd.sglang import launcher, light
from specforge_opd.sglang.native import HOOK_TARGETS, NATIVE_STEP_FIELDS

LAYERS = [9, 1, 5]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    try:
        light.ensure_light_env()
    except light.LightEnvError as e:
        pytest.skip(f"light SGLang environment unavailable: {e}")
    model = tmp_path_factory.mktemp("m")
    cfg = SGLangConfig(max_total_tokens=4096, mem_fraction_static=0.7)
    request = {
        "modes": {
            "verify": launcher.server_args(cfg, model_path=str(model), port=31000, mode="verify", target_layer_ids=LAYERS,
                                           dtype="bfloat16", num_target_layers=36),
            "native": launcher.server_args(cfg, model_path=str(model), port=31001, mode="native", draft_path=str(model),
                                           block_size=16, dtype="bfloat16"),
        },
        "refused": [*launcher.REFUSED_FLAGS, "--tp"],
    }
    return light.run_probe(request)


def test_sglang_parses_and_resolves_the_verify_flags(probe):
    v = probe["modes"]["verify"]
    assert v["errors"] == []
    p, r = v["parsed"], v["resolved"]
    assert p["speculative_algorithm"] == "DFLASH" and p["skip_tokenizer_init"] and p["host"] == "127.0.0.1" and p["port"] == 31000
    assert p["max_total_tokens"] == 4096 and p["mem_fraction_static"] == 0.7 and p["dtype"] == "bfloat16"
    # aux capture only names the convention: no draft runs, the hidden states come back whole
    assert r["speculative_algorithm"] is None and r["aux_hidden_state_capture"] == "dflash"
    assert r["return_aux_hidden_state_layer_ids"] == sorted(LAYERS) and r["return_hidden_states_mode"] == "full"


def test_sglang_parses_and_resolves_the_native_flags(probe):
    n = probe["modes"]["native"]
    assert n["errors"] == []
    r = n["resolved"]
    assert r["speculative_algorithm"] == "DFLASH" and r["speculative_num_draft_tokens"] == 16
    assert r["disable_overlap_schedule"] and r["aux_hidden_state_capture"] is None
    # DFLASH's running-request default, which the native client's in-flight bound reads back from /server_info
    assert r["max_running_requests"] == 48


def test_every_refused_flag_is_a_flag_of_sglang(probe):
    assert all(probe["refused"][f] for f in launcher.REFUSED_FLAGS), probe["refused"]
    assert probe["refused"]["--tp"] == "tp_size"  # argparse's prefix matching: why check_extra_args matches prefixes


def test_sglangs_plugin_loader_runs_our_plugin_and_its_registry_wraps_our_hooks(probe, tmp_path):
    pl = probe["plugins"]
    assert set(pl["registered"]) == set(HOOK_TARGETS.values())
    for hooks in pl["registered"].values():
        assert [(h[0], h[2]) for h in hooks] == [("around", "specforge_opd_native")]
    assert "Executed general plugin: specforge_opd_native" in pl["log"]
    assert pl["wrapped_passes_extend_through"]
    step = pl["wrapped_verify_step"]
    assert set(step) == set(NATIVE_STEP_FIELDS) and step["opd_anchor"] == [10] and step["opd_accepted"] == [2]
    # the real targets are out of a light environment's reach for the reason light.NEEDS_CUDA gives
    assert pl["patched"] == [] and set(pl["import_errors"]) == set(HOOK_TARGETS.values()), pl["import_errors"]
    assert all("Torchvision" in e for e in pl["import_errors"].values()), pl["import_errors"]
    # and SGLang's own failure lines are what the launcher's log scan catches
    log = tmp_path / "server.log"
    log.write_text("\n".join(pl["log"]))
    with pytest.raises(launcher.ServerError, match="Failed to apply hooks to sglang.srt"):
        launcher.check_plugin_log(log)


def test_offline_is_a_clear_error_and_nothing_half_built(tmp_path, monkeypatch):
    from specforge_opd.sglang import wheel

    monkeypatch.setenv("SPECFORGE_OPD_CACHE", str(tmp_path))
    monkeypatch.delenv(wheel.WHEEL_ENV, raising=False)

    def offline(python=None):
        raise wheel.WheelError("could not download sglang 0.5.23: offline")

    monkeypatch.setattr(wheel, "fetch", offline)
    with pytest.raises(light.LightEnvError, match="offline"):
        light.ensure_light_env()
    assert not light.light_dir().exists() and light.light_dir().parent == tmp_path
