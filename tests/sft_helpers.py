"""Tiny inputs for the SFT stage tests: a random target saved as an HF directory with a
word-level tokenizer and a chat template (SpecForge's trainer reads both), and prompt records."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from conftest import TINY_MASK, make_tiny_target

STOP = 1
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "user": 3, "assistant": 4, "system": 5}
    # id 96 (TINY_MASK) has no text: the mask token, never produced by chat text
    vocab.update({f"w{i}": i for i in range(6, TINY_MASK)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_target_dir(root: Path, seed: int = 0):
    """Save a tiny random target + tokenizer to ``root`` and return a TargetBundle-like namespace."""
    model = make_tiny_target(seed)
    tok = make_tokenizer()
    model.save_pretrained(root)
    tok.save_pretrained(root)
    return SimpleNamespace(model=model, tokenizer=tok, path=str(root), identity="tiny", stop_token_ids=[STOP])


def make_prompts(n: int, start: int = 0):
    return [SimpleNamespace(id=f"p{i}", source="test", messages=None,
                            prompt=" ".join(f"w{6 + (i * 7 + k) % 80}" for k in range(3 + i % 4)), answer=None)
            for i in range(start, start + n)]


def tiny_cfg(out: Path, **over):
    from specforge_opd.config import load_config

    base = [
        f"output.dir={out}", "target.path=/nonexistent", "target.max_context=64", "draft.num_hidden_layers=1",
        "draft.block_size=4", f"draft.mask_token_id={TINY_MASK}", "sft.max_new_tokens=8", "sft.batch_size=4",
        "sft.chunk_prompts=4", "sft.verify_prompts=2", "sft.verify_max_new_tokens=12", "training.num_anchors=4",
        "training.learning_rate=1e-3", "training.log_interval=1", "output.tensorboard=false",
        "data.max_prompt_tokens=32",
        # fp32 whatever the CPU: "auto" would train bf16 on one machine and fp32 on another
        "training.mixed_precision=fp32",
    ]
    return load_config(None, base + [f"{k}={v}" for k, v in over.items()])


def crash_after(real_call, steps: int, total: int):
    """A ``subprocess.call`` stand-in for the SFT train step: SpecForge runs ``steps`` of its ``total``
    optimizer steps (checkpointing as configured), then the process "dies" with status 137."""

    def call(cmd, **kw):
        real_call(cmd + [f"training.max_steps={steps}", f"training.total_steps={total}"], **kw)
        return 137

    return call
