"""SFT stage: responses -> features -> SpecForge train -> export, with skip/resume and bad input."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from specforge_opd import stepkeys
from specforge_opd.data import prompts
from specforge_opd.models.drafter import load_specforge_checkpoint
from specforge_opd.models.target import cut_at_stop
from specforge_opd.rollout import responses
from specforge_opd.stages import sft, sft_features, sft_train

from conftest import TINY_MASK
from sft_helpers import STOP, crash_after, make_prompts, make_target_dir, tiny_cfg


@pytest.fixture
def chat_render(monkeypatch):
    """Use engineer A's chat.render_prompt when it exists; else render with the tokenizer's template."""
    try:
        from specforge_opd.data.chat import render_prompt  # noqa: F401
    except ImportError:
        def render(tokenizer, record, cfg):
            msgs = record.messages or [{"role": "user", "content": record.prompt}]
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

        monkeypatch.setattr(prompts, "render_training_prompt", render)


def test_sft_end_to_end_tiny(tmp_path, chat_render, capfd):
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run")
    prompts = make_prompts(8)
    final = sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)

    # responses: one record per prompt, prompt ids = the rendered prompt
    r_dir = next((tmp_path / "run").glob("responses-*"))
    recs = responses.read_responses(r_dir)
    assert [r.id for r in recs] == [p.id for p in prompts]
    assert all(0 < len(r.response_ids) <= 8 for r in recs)

    # features: SpecForge offline layout, loss mask exactly on the response, layer k = hidden_states[k+1]
    f_dir = next((tmp_path / "run").glob("features-*"))
    files = sorted(f_dir.glob("rows_*/data_*.ckpt"))
    assert len(files) == 8
    s = torch.load(files[0], weights_only=True)
    r0 = recs[0]
    assert s["input_ids"].tolist() == r0.prompt_ids + r0.response_ids
    assert s["loss_mask"].tolist() == [0] * len(r0.prompt_ids) + [1] * len(r0.response_ids)
    layer_ids = json.loads((f_dir / "manifest.json").read_text())["target_layer_ids"]
    assert layer_ids == [2]  # build_target_layer_ids(4, 1) = [4 // 2]
    with torch.no_grad():
        hs = bundle.model(s["input_ids"][None], output_hidden_states=True).hidden_states
    assert s["hidden_states"].shape == (1, len(s["input_ids"]), 64)
    torch.testing.assert_close(s["hidden_states"], hs[3])

    # train: SpecForge ran every step (8 samples, batch 1, 1 epoch)
    t_marker = json.loads(next((tmp_path / "run").glob("train-*/DONE.json")).read_text())
    assert t_marker["stats"]["step"] == 8

    # export: SGLang layout, reloads, and the check ran
    c = json.loads((final / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and "auto_map" not in c
    assert c["block_size"] == 4 and c["tie_word_embeddings"] is False
    assert c["dflash_config"] == {"mask_token_id": TINY_MASK, "target_layer_ids": [2]}
    from specforge_opd.models.drafter import load_drafter, read_drafter_metadata

    d = load_drafter(final, target_config=bundle.model.config)
    ck = load_specforge_checkpoint(t_marker["stats"]["checkpoint"], bundle.model.config)
    for k, v in ck.state_dict().items():
        torch.testing.assert_close(d.state_dict()[k], v)
    meta = read_drafter_metadata(final)
    assert meta["verify"]["prompts"] == 2 and meta["verify"]["tau"] >= 1.0

    # a rerun skips every step and leaves the export as it was
    before = (final / "model.safetensors").stat().st_mtime_ns
    capfd.readouterr()
    sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    report = json.loads((tmp_path / "run" / "sft_report.json").read_text())
    assert report["skipped"] == list(sft.STEPS)
    assert (final / "model.safetensors").stat().st_mtime_ns == before


QWEN3_8B = {  # Qwen/Qwen3-8B config.json (the numbers the dry run needs)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def test_dry_run_qwen3_8b_plans_without_weights(tmp_path, monkeypatch, capsys):
    from specforge_opd.config import load_config
    from specforge_opd.data import assets

    real = assets.qwen3_fixture_dir("8b")
    if not (real / "config.json").is_file():  # engineer A's fixture not there yet: the real numbers
        (tmp_path / "8b").mkdir()
        (tmp_path / "8b" / "config.json").write_text(json.dumps(QWEN3_8B))
        monkeypatch.setattr(assets, "qwen3_fixture_dir", lambda size: tmp_path / size)
    cfg = load_config("configs/qwen3-8b/sft.yaml", [f"output.dir={tmp_path / 'run'}"])
    plan = sft.dry_run(cfg)
    out = capsys.readouterr().out
    for step in ("1. responses", "2. features", "3. train", "4. export", "draft config", "GiB"):
        assert step in out
    d = plan["draft_config"]
    assert d["num_hidden_layers"] == 5 and d["block_size"] == 16 and d["hidden_size"] == 4096
    # build_target_layer_ids(36, 5): start 1, end 33, evenly spaced
    assert d["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    est = plan["estimate"]
    # one sample of at most 1024 + 2048 tokens, 5 layers x 4096 x bf16, plus int64 ids and mask
    assert est["feature_bytes_per_sample_max"] == 3072 * (5 * 4096 * 2 + 16)
    assert 7.5e9 < est["target_params"] < 8.5e9
    assert not (tmp_path / "run").exists()  # planning writes nothing


def test_dry_run_cli_all_gpu_configs(tmp_path, monkeypatch, capsys):
    from specforge_opd.cli import main
    from specforge_opd.data import assets

    fixtures = {"8b": QWEN3_8B,
                "4b": {**QWEN3_8B, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
                       "tie_word_embeddings": True},
                "30b-a3b": {**QWEN3_8B, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                            "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                            "num_key_value_heads": 4, "intermediate_size": 6144, "moe_intermediate_size": 768,
                            "num_experts": 128, "num_experts_per_tok": 8}}
    if not (assets.qwen3_fixture_dir("8b") / "config.json").is_file():
        for k, v in fixtures.items():
            (tmp_path / k).mkdir()
            (tmp_path / k / "config.json").write_text(json.dumps(v))
        monkeypatch.setattr(assets, "qwen3_fixture_dir", lambda size: tmp_path / size)
    for size, layers in (("4b", 5), ("30b-a3b", 8)):
        assert main(["sft", "-c", f"configs/qwen3-{size}/sft.yaml", "--dry-run", "--out", str(tmp_path / size)]) == 0
        out = capsys.readouterr().out
        assert f'"num_hidden_layers": {layers}' in out and '"block_size": 16' in out


class _Stop(Exception):
    pass


def _stop_before_train(monkeypatch):
    def stop(*a, **k):
        raise _Stop

    monkeypatch.setattr(sft, "run_train", stop)


def test_kill_during_responses_and_features_resumes_without_duplicates(tmp_path, chat_render, monkeypatch):
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run")
    prompts = make_prompts(10)  # chunks of 4: 4 + 4 + 2
    _stop_before_train(monkeypatch)

    # kill during responses: the 2nd chunk's generation dies
    real_gen = responses.generate_responses
    calls = []

    def gen(bundle_, batch, cfg_, seed, sample_ids=None, batch_size=None, remote=None):
        calls.append(list(sample_ids))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_gen(bundle_, batch, cfg_, seed, sample_ids, batch_size, remote)

    monkeypatch.setattr(responses, "generate_responses", gen)
    with pytest.raises(KeyboardInterrupt):
        sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    r_dir = next((tmp_path / "run").glob("responses-*"))
    assert [f.name for f in sorted(r_dir.glob("chunk_*.jsonl"))] == ["chunk_00000.jsonl"]
    chunk0 = (r_dir / "chunk_00000.jsonl").stat().st_mtime_ns

    # kill during features: the 6th sample dies (batches of sft.batch_size=4, each file written as its batch ends)
    real_feat = sft_features.feature_sample
    n_feat = []

    def feat(*a, **k):
        n_feat.append(1)
        if len(n_feat) == 6:
            raise KeyboardInterrupt
        return real_feat(*a, **k)

    calls.clear()
    monkeypatch.setattr(responses, "generate_responses", lambda *a, **k: (calls.append(k["sample_ids"]), real_gen(*a, **k))[1])
    monkeypatch.setattr(sft_features, "feature_sample", feat)
    with pytest.raises(KeyboardInterrupt):
        sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    # only chunks 1 and 2 were generated; chunk 0 was kept as written
    assert calls == [["p4", "p5", "p6", "p7"], ["p8", "p9"]]
    assert (r_dir / "chunk_00000.jsonl").stat().st_mtime_ns == chunk0
    f_dir = next((tmp_path / "run").glob("features-*"))
    first = sorted(f_dir.glob("rows_*/data_*.ckpt"))
    assert len(first) == 5 and not (f_dir / stepkeys.MARKER).exists()
    mtimes = {f.name: f.stat().st_mtime_ns for f in first}

    # rerun: the 5 finished samples are kept, the other 5 written, each response exactly once
    n_feat.clear()
    monkeypatch.setattr(sft_features, "feature_sample", lambda *a, **k: (n_feat.append(1), real_feat(*a, **k))[1])
    with pytest.raises(_Stop):
        sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    assert len(n_feat) == 5
    files = sorted(f_dir.glob("rows_*/data_*.ckpt"))
    assert [f.name for f in files] == [f"data_{i:08d}.ckpt" for i in range(10)]
    # batches run in length order: the five kept files are whichever were written, untouched
    assert all(f.stat().st_mtime_ns == mtimes[f.name] for f in files if f.name in mtimes)
    recs = responses.read_responses(r_dir)
    assert [r.id for r in recs] == [f"p{i}" for i in range(10)]
    for f, r in zip(files, recs):
        assert torch.load(f, weights_only=True)["input_ids"].tolist() == r.prompt_ids + r.response_ids
    # and the same responses an uninterrupted run generates (greedy, per-prompt seeding)
    again = responses.generate_responses(bundle, [r.prompt_ids for r in recs[4:8]], cfg, seed=cfg.data.seed,
                                   sample_ids=["p4", "p5", "p6", "p7"])
    assert [cut_at_stop(o, {STOP}, 8)[0] for o in again] == [r.response_ids for r in recs[4:8]]


def _rec(i, prompt_len, resp_len):
    return responses.ResponseRecord(id=f"s{i}", prompt_ids=list(range(3, 3 + prompt_len)),
                              response_ids=list(range(10, 10 + resp_len)), finished=True)


def test_zero_supervised_samples_dropped_with_count(tmp_path):
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run")  # max_context 64
    recs = [_rec(0, 5, 6), _rec(1, 5, 0), _rec(2, 5, 1), _rec(3, 63, 4), _rec(4, 62, 4), _rec(5, 70, 3)]
    # supervised tokens: 6, 0 (empty response), 1 (no two consecutive), 1 (truncated), 2, 0 (prompt fills context)
    assert [sft_features.supervised_tokens(r, 64) for r in recs] == [6, 0, 1, 1, 2, 0]
    f_dir = tmp_path / "feat"
    with pytest.warns(UserWarning, match="dropped 4 of 6 samples"):
        stats = sft_features.run_features(f_dir, recs, lambda: bundle.model, [2], cfg)
    assert stats["samples"] == 2 and stats["dropped"] == 4 and stats["supervised_tokens"] == 8
    assert stats["dropped_ids"] == ["s1", "s2", "s3", "s5"]
    files = sorted(f_dir.glob("rows_*/data_*.ckpt"))
    masks = [torch.load(f, weights_only=True)["loss_mask"] for f in files]
    assert [int(m.sum()) for m in masks] == [6, 2]
    assert len(masks[1]) == 64  # truncated to target.max_context, the 2 response tokens that fit


def test_no_supervised_samples_left_is_an_error(tmp_path):
    cfg = tiny_cfg(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(sft.SFTError, match="none of 2 samples"):
            sft_features.run_features(tmp_path / "feat", [_rec(0, 4, 0), _rec(1, 4, 1)], lambda: None, [2], cfg)
    assert not list((tmp_path / "feat").glob("rows_*/*.ckpt"))


def test_killed_training_resumes_from_specforge_checkpoint(tmp_path, chat_render, monkeypatch, capfd):
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run", **{"sft.save_interval": 2, "sft.verify_prompts": 0})
    prompts = make_prompts(8)
    real_call = sft_train.subprocess.call
    # SpecForge runs 4 of its 8 steps (checkpoints at 2 and 4), then the process "dies"
    monkeypatch.setattr(sft_train.subprocess, "call", crash_after(real_call, 4, 8))
    with pytest.raises(sft.SFTError, match="status 137.*resumes"):
        sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    ckpts = next((tmp_path / "run").glob("train-*")) / "checkpoints"
    assert sft_train.latest_checkpoint(ckpts).name == "sft-step4"
    monkeypatch.setattr(sft_train.subprocess, "call", real_call)
    capfd.readouterr()
    sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path)
    out = capfd.readouterr().out
    assert "resuming SpecForge from sft-step4" in out
    steps = [int(m) for m in __import__("re").findall(r"^step (\d+):", out, flags=__import__("re").M)]
    assert steps == [5, 6, 7, 8]  # no step trained twice
    assert sft_train.latest_checkpoint(ckpts).name == "sft-step8"
    state = torch.load(sft_train.latest_checkpoint(ckpts) / "training_state.pt", weights_only=True)
    assert state["global_step"] == 8 and state["epoch_samples"] == 8


def test_validation_curve_segments_select_and_resume(tmp_path, chat_render, monkeypatch, capfd):
    """sft.val_prompts: segments of val_interval steps, a validation tau per segment from exact offline
    replay on held-out prompts, the export is the selected point; the segmented run trains exactly what
    one uninterrupted SpecForge run trains (same LR horizon, no step twice), and resumes after a kill."""
    from specforge_opd.eval.validation import read_curve
    from specforge_opd.models.drafter import load_drafter, read_drafter_metadata

    bundle = make_target_dir(tmp_path / "target")
    prompts, held = make_prompts(8), make_prompts(2, start=20)
    plain = tiny_cfg(tmp_path / "plain", **{"sft.verify_prompts": 0})
    sft.run_sft(plain, bundle=bundle, prompts=prompts, target_path=bundle.path)
    ref_ckpt = sft_train.latest_checkpoint(next((tmp_path / "plain").glob("train-*")) / "checkpoints")
    ref = load_specforge_checkpoint(ref_ckpt, bundle.model.config).state_dict()

    cfg = tiny_cfg(tmp_path / "run", **{"sft.verify_prompts": 0, "sft.val_prompts": 2, "sft.val_interval": 3,
                                        "sft.select": "best_val"})
    real_call = sft_train.subprocess.call
    calls = []

    def die_on_second_segment(cmd, **kw):
        calls.append(cmd)
        if len(calls) == 2:
            return 137
        return real_call(cmd, **kw)

    monkeypatch.setattr(sft_train.subprocess, "call", die_on_second_segment)
    with pytest.raises(sft.SFTError, match="status 137"):
        sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path, val_prompts=held)
    t_dir = next((tmp_path / "run").glob("train-*"))
    assert [p["step"] for p in read_curve(t_dir)] == [3]
    monkeypatch.setattr(sft_train.subprocess, "call", real_call)
    capfd.readouterr()
    final = sft.run_sft(cfg, bundle=bundle, prompts=prompts, target_path=bundle.path, val_prompts=held)
    out = capfd.readouterr().out
    steps = [int(m) for m in __import__("re").findall(r"^step (\d+):", out, flags=__import__("re").M)]
    assert steps == [4, 5, 6, 7, 8]  # the resumed segments train each remaining step once
    curve = read_curve(t_dir)
    assert [p["step"] for p in curve] == [3, 6, 8]
    assert all(p["tau"] >= 1.0 and p["drafter_flops"] > 0 for p in curve)
    assert curve[0]["drafter_flops"] < curve[1]["drafter_flops"] < curve[2]["drafter_flops"]
    # every curve export carries its FLOPs ledger (a matched baseline is a curve export, not the final one)
    assert [read_drafter_metadata(p["export"])["flops"]["drafter_budget"] for p in curve] == \
        pytest.approx([p["drafter_flops"] for p in curve])
    # the last segment's checkpoint is what one uninterrupted run produces
    last = load_specforge_checkpoint(curve[-1]["checkpoint"], bundle.model.config).state_dict()
    for k, v in ref.items():
        torch.testing.assert_close(last[k], v)
    # the export is the best point (earliest of equals), from its own curve export
    best = max(curve, key=lambda p: (p["tau"], -p["step"]))
    meta = read_drafter_metadata(final)
    assert meta["step"] == best["step"] and meta["validation"]["selected_tau"] == best["tau"]
    got = load_drafter(final, target_config=bundle.model.config).state_dict()
    want = load_drafter(best["export"], target_config=bundle.model.config).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "run" / "sft_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_validation_needs_room_in_the_pool(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", **{"sft.val_prompts": 2})
    assert cfg.data.num_prompts is None
    with pytest.raises(sft.SFTError, match="data.num_prompts"):
        sft._load_val_prompts(cfg)


def test_validation_without_room_fails_before_any_target_work(tmp_path, monkeypatch):
    """A pool with no prompt left after data.num_prompts is refused before the responses step, not after the
    responses and features it would have paid for."""
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run", **{"sft.val_prompts": 2})  # data.num_prompts unset: the whole pool trains
    monkeypatch.setattr(sft, "run_responses", lambda *a, **k: pytest.fail("responses ran before the validation check"))
    with pytest.raises(sft.SFTError, match="data.num_prompts"):
        sft.run_sft(cfg, bundle=bundle, prompts=make_prompts(4), target_path=bundle.path)
    assert not list((tmp_path / "run").glob("responses-*"))


def test_segments_and_selection_rules():
    from specforge_opd.eval.validation import segment_ends, select

    assert segment_ends(8, 3) == [3, 6, 8] and segment_ends(6, 3) == [3, 6] and segment_ends(2, 5) == [2]
    with pytest.raises(ValueError, match="val_interval"):
        segment_ends(8, 0)
    pts = [{"step": 3, "tau": 1.2}, {"step": 6, "tau": 1.4}, {"step": 9, "tau": 1.4}, {"step": 12, "tau": 1.3}]
    assert select(pts, "best_val")["step"] == 6  # the earliest of the best
    assert select(pts, "last")["step"] == 12
    with pytest.raises(ValueError, match="sft.select"):
        select(pts, "loss")


def test_validation_prompts_follow_the_trained_ones_in_the_pool(tmp_path):
    """Validation prompts are the pool's next ones after data.num_prompts: disjoint from SFT's, same order."""
    cfg = tiny_cfg(tmp_path / "run", **{"data.num_prompts": 5, "sft.val_prompts": 3, "data.max_prompt_tokens": 256})
    trained = sft._load_prompts(cfg)
    val = sft._load_val_prompts(cfg)
    assert len(trained) == 5 and len(val) == 3
    assert not {p.id for p in trained} & {p.id for p in val}
    from specforge_opd.data.prompts import training_pool

    eight = training_pool(cfg.data.model_copy(update={"num_prompts": 8}))
    assert [p.id for p in eight] == [p.id for p in trained + val]


def test_plateau_rule():
    """A plateau is `patience` points in a row within the noise band of the best point before them."""
    from specforge_opd.eval.validation import plateaued

    def pts(*taus):
        return [{"step": 100 * (i + 1), "tau": t} for i, t in enumerate(taus)]

    assert not plateaued(pts(1.1, 1.2, 1.3, 1.4), 2, 0.02)  # still rising
    assert plateaued(pts(1.1, 1.4, 1.41, 1.39), 2, 0.02)  # two points within the band of 1.4
    assert not plateaued(pts(1.1, 1.4, 1.41, 1.43), 2, 0.02)  # 1.43 beats 1.40 by more than the band
    assert not plateaued(pts(1.4, 1.3), 2, 0.02)  # fewer points than patience + 1
    assert plateaued(pts(1.5, 1.3, 1.2), 2, 0.0)  # falling is a plateau too
    assert not plateaued(pts(1.0, 1.0, 1.0), 0, 0.02)  # patience 0: never stops
    assert plateaued(list(reversed(pts(1.3, 1.3, 1.3))), 2, 0.0)  # step order, not list order


def test_plateau_stops_training_before_the_step_cap(tmp_path, chat_render, monkeypatch, capfd):
    """sft.plateau_patience: once the curve is flat, no further segment trains, and the stats say where it stopped;
    a rerun trains nothing more."""
    from specforge_opd.eval import validation

    bundle = make_target_dir(tmp_path / "target")
    monkeypatch.setattr(validation.ValidationSet, "tau", lambda self, drafter: 1.25)
    cfg = tiny_cfg(tmp_path / "run", **{"sft.verify_prompts": 0, "sft.val_prompts": 2, "sft.val_interval": 2,
                                        "sft.max_steps": 10, "sft.plateau_patience": 1, "sft.plateau_band": 0.0})
    sft.run_sft(cfg, bundle=bundle, prompts=make_prompts(8), target_path=bundle.path, val_prompts=make_prompts(2, start=20))
    out = capfd.readouterr().out
    steps = [int(m) for m in __import__("re").findall(r"^step (\d+):", out, flags=__import__("re").M)]
    assert steps == [1, 2, 3, 4]  # segments to 2 and 4; the flat point at 4 stops it before 10
    assert "plateau at step 4" in out
    t_dir = next((tmp_path / "run").glob("train-*"))
    stats = json.loads((t_dir / stepkeys.MARKER).read_text())["stats"]
    assert stats["plateau_step"] == 4 and stats["step"] == 4 and [p["step"] for p in stats["curve"]] == [2, 4]
    assert stats["selected"]["step"] == 2  # the earliest of equal taus
    # the same rule again: the step stays done, nothing trains
    sft.run_sft(cfg, bundle=bundle, prompts=make_prompts(8), target_path=bundle.path, val_prompts=make_prompts(2, start=20))
    assert not __import__("re").findall(r"^step (\d+):", capfd.readouterr().out, flags=__import__("re").M)
    # a looser rule (more patience) continues the stopped run from its last checkpoint, its curve kept
    looser = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"plateau_patience": 3})})
    final = sft.run_sft(looser, bundle=bundle, prompts=make_prompts(8), target_path=bundle.path,
                        val_prompts=make_prompts(2, start=20))
    out = capfd.readouterr().out
    assert "continuing it" in out
    steps = [int(m) for m in __import__("re").findall(r"^step (\d+):", out, flags=__import__("re").M)]
    assert steps == [5, 6, 7, 8]  # segments to 6 and 8; 3 flat points after the best at 2 stop it at 8
    stats = json.loads((t_dir / stepkeys.MARKER).read_text())["stats"]
    assert [p["step"] for p in stats["curve"]] == [2, 4, 6, 8] and stats["plateau_step"] == 8
    assert json.loads((final / "specforge_opd.json").read_text())["validation"]["plateau_step"] == 8


def test_bf16_drafter_training_on_cpu(tmp_path, chat_render):
    """training.mixed_precision=bf16: features are stored in bf16 and SpecForge trains a bf16 drafter on a CPU
    (fp32 features into a bf16 fc was SpecForge's dtype error); the export loads and the features key differs."""
    from specforge_opd.models.drafter import load_drafter

    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run", **{"sft.verify_prompts": 1, "training.mixed_precision": "bf16"})
    assert sft_features.drafter_dtype(cfg) == "bfloat16" and sft_features.drafter_dtype(tiny_cfg(tmp_path / "x")) == "float32"
    final = sft.run_sft(cfg, bundle=bundle, prompts=make_prompts(6), target_path=bundle.path)
    f_dir = next((tmp_path / "run").glob("features-*"))
    sample = torch.load(sorted(f_dir.glob("rows_*/data_*.ckpt"))[0], weights_only=True)
    assert sample["hidden_states"].dtype == torch.bfloat16
    import yaml

    run = yaml.safe_load(next((tmp_path / "run").glob("train-*/run.yaml")).read_text())
    assert run["model"]["torch_dtype"] == "bfloat16"
    load_drafter(final, target_config=bundle.model.config)
    # the choice and the machine are on record, in the report and in the export
    report = json.loads((tmp_path / "run" / "sft_report.json").read_text())
    assert report["precision"]["requested"] == "bf16" and report["precision"]["value"] == "bf16"
    assert {"cpu_model", "cpu_capability", "cpu_bf16_native"} <= set(report["machine"])
    from specforge_opd.models.drafter import read_drafter_metadata

    assert read_drafter_metadata(final)["precision"]["value"] == "bf16"
    # fp32 features of the same responses live under another key
    cfg32 = tiny_cfg(tmp_path / "run", **{"sft.verify_prompts": 1})
    sft.run_sft(cfg32, bundle=bundle, prompts=make_prompts(6), target_path=bundle.path)
    assert len(list((tmp_path / "run").glob("features-*"))) == 2


def test_pause_exports_the_best_point_so_far_and_the_same_command_continues(tmp_path, chat_render, monkeypatch, capfd):
    """sft.pause_at_step: the run stops at a validation point without being marked done; its export is the best
    point so far; rerunning without the pause trains only the remaining steps and re-exports."""
    from specforge_opd.eval import validation
    from specforge_opd.models.drafter import read_drafter_metadata

    bundle = make_target_dir(tmp_path / "target")
    taus = iter([1.1, 1.3, 1.2, 1.5])
    monkeypatch.setattr(validation.ValidationSet, "tau", lambda self, drafter: next(taus))
    over = {"sft.verify_prompts": 0, "sft.val_prompts": 2, "sft.val_interval": 2, "sft.max_steps": 8}
    args = dict(bundle=bundle, prompts=make_prompts(8), target_path=bundle.path, val_prompts=make_prompts(2, start=20))
    final = sft.run_sft(tiny_cfg(tmp_path / "run", **over, **{"sft.pause_at_step": 3}), **args)
    out = capfd.readouterr().out
    assert "pausing at step 4" in out
    t_dir = next((tmp_path / "run").glob("train-*"))
    assert not (t_dir / stepkeys.MARKER).exists()
    meta = read_drafter_metadata(final)
    assert meta["step"] == 4 and meta["validation"]["paused_at"] == 4 and meta["validation"]["selected_tau"] == 1.3
    sft.run_sft(tiny_cfg(tmp_path / "run", **over), **args)
    out = capfd.readouterr().out
    steps = [int(m) for m in __import__("re").findall(r"^step (\d+):", out, flags=__import__("re").M)]
    assert steps == [5, 6, 7, 8]  # continued, nothing trained twice
    assert (t_dir / stepkeys.MARKER).exists()
    meta = read_drafter_metadata(final)
    assert meta["step"] == 8 and meta["validation"]["paused_at"] is None and meta["validation"]["selected_tau"] == 1.5


def test_a_continued_run_that_keeps_its_selected_step_updates_the_export_record(tmp_path, chat_render, monkeypatch, capfd):
    """A paused run continued to its end selects the same step again: the weights are not re-exported, but the
    export's validation record (curve, pause, plateau) must describe the whole run, not the pause."""
    from specforge_opd.eval import validation
    from specforge_opd.models.drafter import read_drafter_metadata

    bundle = make_target_dir(tmp_path / "target")
    taus = iter([1.1, 1.5, 1.2, 1.3])
    monkeypatch.setattr(validation.ValidationSet, "tau", lambda self, drafter: next(taus))
    over = {"sft.verify_prompts": 0, "sft.val_prompts": 2, "sft.val_interval": 2, "sft.max_steps": 8}
    args = dict(bundle=bundle, prompts=make_prompts(8), target_path=bundle.path, val_prompts=make_prompts(2, start=20))
    final = sft.run_sft(tiny_cfg(tmp_path / "run", **over, **{"sft.pause_at_step": 3}), **args)
    meta = read_drafter_metadata(final)
    assert meta["step"] == 4 and meta["validation"]["paused_at"] == 4 and len(meta["validation"]["curve"]) == 2
    weights = (final / "model.safetensors").read_bytes()
    sft.run_sft(tiny_cfg(tmp_path / "run", **over), **args)
    assert "validation record brought up to step 8" in capfd.readouterr().out
    meta = read_drafter_metadata(final)
    assert meta["step"] == 4 and meta["validation"]["selected_step"] == 4
    assert meta["validation"]["paused_at"] is None
    assert [p["step"] for p in meta["validation"]["curve"]] == [2, 4, 6, 8]
    assert (final / "model.safetensors").read_bytes() == weights


def test_train_key_covers_the_fields_specforge_reads_and_only_those(tmp_path):
    """The SFT train step's key holds every training.* field specforge_run_config reads, so changing one retrains;
    a training field only the OPD trainer reads (an added one included) leaves finished SFT runs valid."""
    from specforge_opd.config import TrainingConfig

    cfg = tiny_cfg(tmp_path / "run")
    run = sft_train.specforge_run_config(cfg, target_path="t", draft_config_file=tmp_path / "c.json", features=tmp_path,
                                   out_dir=tmp_path / "o", num_samples=8, mask_token_id=5, gpus=0)
    for name in TrainingConfig.model_fields:
        changed = {"lr_scheduler": "constant", "attention_backend": "eager", "mixed_precision": "bf16"}.get(name)
        default = getattr(cfg.training, name)
        if changed is None:
            if isinstance(default, bool) or not isinstance(default, (int, float)):
                continue
            changed = default * 2 if default else 1
        other = cfg.model_copy(update={"training": cfg.training.model_copy(update={name: changed})})
        run2 = sft_train.specforge_run_config(other, target_path="t", draft_config_file=tmp_path / "c.json", features=tmp_path,
                                        out_dir=tmp_path / "o", num_samples=8, mask_token_id=5, gpus=0)
        keyed = sft_train.sft_training_inputs(other) != sft_train.sft_training_inputs(cfg)
        assert keyed == (run2 != run), f"training.{name}: in the key {keyed}, changes the SpecForge run {run2 != run}"


def test_train_samples_trains_on_a_prefix_of_one_shared_features_step(tmp_path, chat_render):
    """The points of a data curve share the responses and features steps: ``sft.train_samples``
    trains on hard links to the first N feature files, and only the train step's key changes."""
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run")
    ps = make_prompts(8)
    sft.run_sft(cfg, bundle=bundle, prompts=ps, target_path=bundle.path)
    f_dir = next((tmp_path / "run").glob("features-*"))
    assert len(list((tmp_path / "run").glob("train-*"))) == 1
    part = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"train_samples": 3})})
    sft.run_sft(part, bundle=bundle, prompts=ps, target_path=bundle.path)
    report = json.loads((tmp_path / "run" / "sft_report.json").read_text())
    assert report["skipped"][:2] == ["responses", "features"]  # nothing generated or captured again
    sub = next((tmp_path / "run").glob("features-*-first3"))
    files = sorted(sub.glob("rows_*/data_*.ckpt"))
    assert [f.name for f in files] == [f"data_{j:08d}.ckpt" for j in range(3)]
    assert all(f.stat().st_ino == sft_features.feature_path(f_dir, j).stat().st_ino for j, f in enumerate(files))
    trains = sorted((tmp_path / "run").glob("train-*/DONE.json"), key=lambda p: p.stat().st_mtime)
    assert len(trains) == 2 and json.loads(trains[-1].read_text())["stats"]["step"] == 3  # 3 samples, 1 epoch
    with pytest.raises(sft.SFTError, match="sft.train_samples=9 but the features step holds 8"):
        sft_features.subset_features(f_dir, tmp_path / "sub9", 9)


def test_sft_pool_drops_prompts_over_the_limit_before_the_cap(tmp_path, monkeypatch):
    """SFT's pool is the OPD stage's pool: the target's tokenizer goes to ``training_pool``, so
    ``data.num_prompts`` counts prompts that fit ``data.max_prompt_tokens``."""
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run", **{"data.num_prompts": 5, "sft.val_prompts": 2})
    seen = []

    class Stop(Exception):
        pass

    def pool(data_cfg, **kw):
        seen.append(kw.get("tokenizer"))
        raise Stop

    monkeypatch.setattr(prompts, "training_pool", pool)
    with pytest.raises(Stop):
        sft.run_sft(cfg, bundle=bundle, target_path=bundle.path)
    with pytest.raises(Stop):
        sft._load_val_prompts(cfg, bundle.tokenizer)
    assert seen == [bundle.tokenizer, bundle.tokenizer]


def _finished_run_over_six_of_ten_prompts(tmp_path, monkeypatch):
    """A tiny SFT run (chunks of 4 prompts) whose responses and features steps finished over the
    first 6 of 10 prompts; training is stopped. Returns ``(bundle, cfg, the 10 prompts)``."""
    bundle = make_target_dir(tmp_path / "target")
    cfg = tiny_cfg(tmp_path / "run")
    ps = make_prompts(10)
    _stop_before_train(monkeypatch)
    with pytest.raises(_Stop):
        sft.run_sft(cfg, bundle=bundle, prompts=ps[:6], target_path=bundle.path)
    return bundle, cfg, ps


def test_a_grown_pool_reuses_the_finished_chunks_and_samples_of_a_smaller_one(tmp_path, chat_render, monkeypatch):
    """A run over 10 prompts after a finished run over the first 6 generates only the chunks whose
    prompts are new and links every feature file whose tokens a finished capture already holds."""
    bundle, cfg, ps = _finished_run_over_six_of_ten_prompts(tmp_path, monkeypatch)
    small_r = next((tmp_path / "run").glob("responses-*"))
    small_f = next((tmp_path / "run").glob("features-*"))

    real_gen, real_feat = responses.generate_responses, sft_features.feature_sample
    calls, n_feat = [], []
    monkeypatch.setattr(responses, "generate_responses", lambda *a, **k: (calls.append(k["sample_ids"]), real_gen(*a, **k))[1])
    monkeypatch.setattr(sft_features, "feature_sample", lambda *a, **k: (n_feat.append(1), real_feat(*a, **k))[1])
    with pytest.raises(_Stop):
        sft.run_sft(cfg, bundle=bundle, prompts=ps, target_path=bundle.path)
    # chunk 0 (p0-p3) is the small run's; chunk 1 (p4-p7) is not (the small run's held p4, p5 only)
    assert calls == [["p4", "p5", "p6", "p7"], ["p8", "p9"]]
    big_r = next(d for d in (tmp_path / "run").glob("responses-*") if d != small_r)
    assert (big_r / "chunk_00000.jsonl").read_bytes() == (small_r / "chunk_00000.jsonl").read_bytes()
    big_f = next(d for d in (tmp_path / "run").glob("features-*") if d != small_f)
    # samples 0-5 hold the same tokens in both (greedy, per-prompt seeding): linked, not captured
    assert len(n_feat) == 4
    for j in range(6):
        assert sft_features.feature_path(big_f, j).stat().st_ino == sft_features.feature_path(small_f, j).stat().st_ino
    recs = responses.read_responses(big_r)
    for j, r in enumerate(recs):
        s = torch.load(sft_features.feature_path(big_f, j), weights_only=True)
        assert s["input_ids"].tolist() == r.prompt_ids + r.response_ids
    # another generation setting is no donor
    other = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"max_new_tokens": 6})})
    calls.clear()
    with pytest.raises(_Stop):
        sft.run_sft(other, bundle=bundle, prompts=ps[:6], target_path=bundle.path)
    assert calls == [["p0", "p1", "p2", "p3"], ["p4", "p5"]]


def test_step_keys_name_the_target_dtype_off_the_default():
    """A bf16 target answers and captures differently from the same weights in float32: its responses and
    features steps (and donor matching, which compares these inputs) must not share keys with float32's,
    while float32 keys stay what they were."""
    from specforge_opd.config import load_config
    from specforge_opd.stages.sft import features_inputs, responses_inputs
    from specforge_opd.stepkeys import hash_inputs

    fp32 = load_config(None, [])
    bf16 = load_config(None, ["target.dtype=bfloat16"])
    tok = [("a", [1, 2, 3])]
    r32, r16 = responses_inputs(fp32, "tid", tok), responses_inputs(bf16, "tid", tok)
    assert "target_dtype" not in r32 and r16["target_dtype"] == "bfloat16"
    assert hash_inputs(r32) != hash_inputs(r16)
    # the float32 key is the one runs before this field were stored under
    assert r32 == {"target": "tid", "prompts": hash_inputs({"p": tok}), "n": 1, "temperature": fp32.sft.temperature,
                   "max_new_tokens": fp32.sft.max_new_tokens, "chunk": fp32.sft.chunk_prompts, "seed": fp32.data.seed,
                   "stop": list(fp32.target.stop_token_ids), "backend": fp32.rollout.backend}
    # features vary "responses" when matching donors: the dtype must sit among the fields that do not vary
    f32, f16 = features_inputs(fp32, "rk", "tid", [1, 2]), features_inputs(bf16, "rk", "tid", [1, 2])
    assert "target_dtype" not in f32 and f16["target_dtype"] == "bfloat16"


def test_a_packed_responses_step_is_reused_and_donates_like_a_plain_one(tmp_path, chat_render, monkeypatch):
    """A finished responses step packed with gzip (what the repository carries) reads back record for
    record, is reused whole through ``sft.reuse_from``, and donates its chunks to a grown pool."""
    bundle, cfg, ps = _finished_run_over_six_of_ten_prompts(tmp_path, monkeypatch)
    plain = next((tmp_path / "run").glob("responses-*"))
    packed = tmp_path / "cache" / plain.name
    assert responses.pack_responses(plain, packed) == 2
    assert sorted(f.name for f in packed.iterdir()) == ["DONE.json", "chunk_00000.jsonl.gz", "chunk_00001.jsonl.gz"]
    assert responses.read_responses(packed) == responses.read_responses(plain)
    # packing a packed step keeps every chunk, byte for byte
    repacked = tmp_path / "repacked" / plain.name
    assert responses.pack_responses(packed, repacked) == 2
    assert {f.name: f.read_bytes() for f in repacked.iterdir()} == {f.name: f.read_bytes() for f in packed.iterdir()}
    with pytest.raises(stepkeys.SFTError, match="not a finished responses step"):
        responses.pack_responses(tmp_path / "run", tmp_path / "nowhere")

    real_gen = responses.generate_responses
    calls = []
    monkeypatch.setattr(responses, "generate_responses", lambda *a, **k: (calls.append(k["sample_ids"]), real_gen(*a, **k))[1])
    # the same pool in a new output dir: the packed step is reused whole, nothing is generated
    again = cfg.model_copy(update={"output": cfg.output.model_copy(update={"dir": str(tmp_path / "again")}),
                                   "sft": cfg.sft.model_copy(update={"reuse_from": str(tmp_path / "cache")})})
    with pytest.raises(_Stop):
        sft.run_sft(again, bundle=bundle, prompts=ps[:6], target_path=bundle.path)
    assert calls == []
    assert not list((tmp_path / "again").glob("responses-*"))
    # a grown pool generates only what the packed chunks do not answer
    grown = again.model_copy(update={"output": cfg.output.model_copy(update={"dir": str(tmp_path / "grown")})})
    with pytest.raises(_Stop):
        sft.run_sft(grown, bundle=bundle, prompts=ps, target_path=bundle.path)
    assert calls == [["p4", "p5", "p6", "p7"], ["p8", "p9"]]
    big = next((tmp_path / "grown").glob("responses-*"))
    assert (big / "chunk_00000.jsonl").read_bytes() == (plain / "chunk_00000.jsonl").read_bytes()


def test_prompts_dropped_over_the_limit_are_said(capsys):
    """The pool counts a prompt's own text and the limit applies with the chat template, so the
    responses step can keep fewer prompts than data.num_prompts: it says how many it dropped."""
    from specforge_opd.config import load_config
    from specforge_opd.stages.sft import _say_skipped

    cfg = load_config(None, ["data.max_prompt_tokens=512"])
    _say_skipped("sft responses", 3, 128, cfg)
    out = capsys.readouterr().out
    assert "[sft responses] 3 of 128 prompts are over 512 tokens with the chat template" in out and "125 kept" in out
    assert "data.max_prompt_tokens" in out
    _say_skipped("sft responses", 0, 128, cfg)
    assert capsys.readouterr().out == ""
