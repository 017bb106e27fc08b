"""Shared fixtures: tiny random models built in the test (milliseconds), and the
embedded target converted once per test session (only for tests that must use it)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TINY_VOCAB = 97
TINY_MASK = 96


def make_tiny_target(seed: int = 0, vocab: int = TINY_VOCAB, layers: int = 4, hidden: int = 64):
    """A random Llama target: vocab 97, 4 layers, hidden 64, 4 heads (2 KV)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    return model


def make_tiny_drafter(target, seed: int = 1, block_size: int = 4, layers: int = 2, mask_token_id: int = TINY_MASK):
    from specforge_opd.models.drafter import build_drafter, derive_draft_config

    dcfg = derive_draft_config(target.config, num_hidden_layers=layers, block_size=block_size, mask_token_id=mask_token_id)
    return build_drafter(dcfg, "sdpa", seed=seed).eval()


@pytest.fixture
def tiny_target():
    return make_tiny_target()


@pytest.fixture
def tiny_drafter(tiny_target):
    return make_tiny_drafter(tiny_target)


@pytest.fixture(scope="session")
def embedded_target_dir():
    """The embedded SmolLM2 target as an HF directory, converted once per session."""
    from specforge_opd.data.assets import ensure_target

    return ensure_target()
