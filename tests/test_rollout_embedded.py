"""Speculative rollout on the embedded SmolLM2 target: lossless on real prompts, and the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.embedded

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Explain photosynthesis in two sentences."}],
]


@pytest.fixture(scope="module")
def smol(embedded_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(embedded_target_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(embedded_target_dir)
    return model, tok


def _ids(tok, messages):
    from specforge_opd.data.chat import render_prompt

    return tok(render_prompt(tok, messages, thinking=False), add_special_tokens=False)["input_ids"]


def test_lossless_greedy_on_real_prompts(smol):
    """Speculative output == the target's own greedy decoding (HF generate, no padding, one
    prompt at a time); a divergence is allowed only where the top-2 logit gap < 1e-4 (DESIGN.md)."""
    from specforge_opd.config import RolloutConfig
    from specforge_opd.data.assets import EMBEDDED_MASK_TOKEN_ID
    from specforge_opd.models.drafter import build_drafter, derive_draft_config
    from specforge_opd.rollout.engine import SpeculativeEngine

    model, tok = smol
    dcfg = derive_draft_config(model.config, num_hidden_layers=1, block_size=8, mask_token_id=EMBEDDED_MASK_TOKEN_ID)
    drafter = build_drafter(dcfg, seed=0).eval()
    stops = [tok.eos_token_id]
    prompts = [_ids(tok, m) for m in PROMPTS]
    eng = SpeculativeEngine(model, drafter, RolloutConfig(max_new_tokens=32), stop_token_ids=stops, mask_token_id=EMBEDDED_MASK_TOKEN_ID)
    recs = eng.generate(prompts)
    for p, rec in zip(prompts, recs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=stops,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=stops[0])
        ref_ids = ref.sequences[0, len(p):].tolist()
        out = rec.input_ids[rec.prompt_len:].tolist()
        for i, (a, b) in enumerate(zip(out, ref_ids)):
            if a != b:
                top2 = torch.topk(ref.logits[i][0], 2).values
                assert float(top2[0] - top2[1]) < 1e-4, f"diverges at token {i}: {a} != {b}"
                break
        else:
            assert out == ref_ids
        assert rec.features.shape == (rec.input_ids.numel() - 1, model.config.hidden_size)


def test_rollout_and_inspect_cli(tmp_path, embedded_target_dir, capsys):
    from transformers import AutoConfig

    from specforge_opd.cli import main
    from specforge_opd.data.assets import EMBEDDED_MASK_TOKEN_ID
    from specforge_opd.models.drafter import build_drafter, derive_draft_config, save_drafter

    tcfg = AutoConfig.from_pretrained(embedded_target_dir)
    dcfg = derive_draft_config(tcfg, num_hidden_layers=1, block_size=4, mask_token_id=EMBEDDED_MASK_TOKEN_ID)
    save_drafter(build_drafter(dcfg, seed=0), tmp_path / "drafter")
    out = tmp_path / "shards"
    # a small local prompt file keeps the test off the 17K-conversation ShareGPT pool
    qa = tmp_path / "gsm8k.jsonl"
    qa.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in ("What is 2+3?", "Name a prime number.", "Is 9 odd?")))
    rc = main([
        "rollout", f"draft.path={tmp_path / 'drafter'}", "data.train_sources=[gsm8k]", f"data.local_files={{gsm8k: {qa}}}",
        "data.exclude_eval=[]", "rollout.max_new_tokens=6",
        "rollout.batch_size=2", "rollout.sequences_per_shard=2", "rollout.teacher=topk", "rollout.teacher_topk=4",
        "target.max_context=2048", "--out", str(out),
    ])
    assert rc == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["sequences"] == 3 and s["shards"] == 2
    assert s["meta"]["block_size"] == 4 and s["meta"]["mask_token_id"] == EMBEDDED_MASK_TOKEN_ID
    assert s["completion_tokens"] <= 18 and s["blocks"] >= 3
