"""FLOPs accounting for drafter training and target compute (matched-FLOPs comparisons, paper section 5).

Convention: one multiply-add is 2 FLOPs; a dense ``[n, a] @ [a, b]`` costs
``2 * n * a * b``. Backward of a matmul whose weight is trained costs twice its
forward (gradient w.r.t. the input and w.r.t. the weight); a frozen weight
whose input needs a gradient costs one forward's worth (input gradient only); a
matmul whose input is a leaf and whose weight is trained costs one forward's
worth (weight gradient only). Attention score/value products (``QK^T``, ``PV``)
have no weights: their backward costs twice their forward. Norms, activations,
softmax, RoPE and the embedding lookup are not counted (they are O(hidden) per
token, well under 1% of the matmuls at these sizes).

Two ledgers are kept apart on purpose, because the paper's matched-FLOPs
comparison is about the *drafter-training* budget:

* ``drafter_train``: the drafter's forward and backward (its decoder layers, the
  ``fc`` projection of the context features, and the target's frozen lm_head
  that the drafter borrows, forward + input gradient), plus on the OPD side the
  teacher's lm_head forward over the replayed slots (``teacher_form: full``).
* ``target``: the target's forwards for rollouts (prefill + verify steps) and for
  feature captures (SFT response capture, or the trainer's recomputation).

Checkpoints record ``FlopsLedger.to_dict()`` under the ``"flops"`` key of their
metadata (``specforge_opd.models.drafter.save_drafter(..., metadata={"flops": ...})``);
``specforge_opd.eval.evaluate`` copies it into ``eval.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional


def _text(cfg):
    return getattr(cfg, "text_config", cfg)


def _head_dims(cfg) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim) of a HF config."""
    nh = int(cfg.num_attention_heads)
    nkv = int(getattr(cfg, "num_key_value_heads", None) or nh)
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // nh)
    return nh, nkv, hd


def decoder_layer_matmul_flops_per_token(cfg, intermediate_size: Optional[int] = None) -> int:
    """Forward FLOPs of one Llama/Qwen3 decoder layer's weight matmuls for one token.

    ``2 * H * (nh*hd)`` (q) + ``2 * 2 * H * (nkv*hd)`` (k, v) + ``2 * (nh*hd) * H`` (o)
    + ``3 * 2 * H * I`` (gate, up, down; SwiGLU MLP). Attention products are counted
    separately (``attention_flops``) because they depend on the attended length.
    """
    c = _text(cfg)
    H = int(c.hidden_size)
    I = int(intermediate_size or c.intermediate_size)
    nh, nkv, hd = _head_dims(c)
    return 2 * H * nh * hd + 4 * H * nkv * hd + 2 * nh * hd * H + 6 * H * I


def attention_flops(cfg, num_layers: int, attended_keys: int) -> int:
    """Forward FLOPs of ``QK^T`` and ``PV`` summed over queries: ``4 * L * nh * hd * sum_q keys(q)``.

    ``attended_keys`` is the total, over query tokens, of the keys each one attends to
    (for a causal prefill of n tokens it is n(n+1)/2).
    """
    nh, _, hd = _head_dims(_text(cfg))
    return 4 * num_layers * nh * hd * int(attended_keys)


def lm_head_flops(hidden_size: int, vocab_size: int, tokens: int) -> int:
    """Forward FLOPs of an lm_head over ``tokens`` positions: ``2 * H * V * tokens``."""
    return 2 * int(hidden_size) * int(vocab_size) * int(tokens)


# ---------------------------------------------------------------------------
# drafter


def drafter_forward_flops(
    draft_config,
    *,
    query_slots: int,
    context_rows: int,
    attended_keys: int,
    lm_head_slots: int,
) -> dict[str, int]:
    """Forward FLOPs of a DFlash drafter, split by part.

    Args:
        draft_config: the drafter's HF config (``dflash_config.target_layer_ids``).
        query_slots: block slots run through the drafter layers (blocks * block_size).
        context_rows: context feature rows projected by ``fc`` and by each layer's k/v.
        attended_keys: sum over query slots of the keys each attends to (context + block).
        lm_head_slots: slots whose logits are computed (drafted slots, blocks * (block_size - 1)).

    Returns:
        dict of ints: ``fc`` (``2 * (n_ids*H) * H * context_rows``), ``layers_query``
        (decoder-layer matmuls over the block slots), ``layers_context`` (k and v
        projections of the context rows: ``4 * H * nkv*hd`` per row per layer),
        ``attention``, ``lm_head`` (``2 * H * V * lm_head_slots``; the target's), ``total``.
    """
    c = draft_config
    H = int(c.hidden_size)
    L = int(c.num_hidden_layers)
    n_ids = len(c.dflash_config["target_layer_ids"])
    _, nkv, hd = _head_dims(c)
    parts = {
        "fc": 2 * n_ids * H * H * int(context_rows),
        "layers_query": L * decoder_layer_matmul_flops_per_token(c) * int(query_slots),
        "layers_context": L * 4 * H * nkv * hd * int(context_rows),
        "attention": attention_flops(c, L, attended_keys),
        "lm_head": lm_head_flops(H, c.vocab_size, lm_head_slots),
    }
    parts["total"] = sum(parts.values())
    return parts


def drafter_training_flops(
    draft_config,
    *,
    query_slots: int,
    context_rows: int,
    attended_keys: int,
    lm_head_slots: int,
) -> dict[str, int]:
    """Forward + backward FLOPs of one drafter training pass (SFT or OPD replay).

    Backward multipliers (see module docstring): decoder-layer matmuls and the
    attention products 2x forward; ``fc`` 1x (weight gradient only: the context
    features are target outputs, no gradient flows into them); the lm_head 1x
    (frozen target weight, gradient w.r.t. the drafter's hidden state only).

    Returns:
        dict: ``forward``, ``backward``, ``total`` (ints, FLOPs).
    """
    f = drafter_forward_flops(
        draft_config,
        query_slots=query_slots,
        context_rows=context_rows,
        attended_keys=attended_keys,
        lm_head_slots=lm_head_slots,
    )
    backward = 2 * (f["layers_query"] + f["layers_context"] + f["attention"]) + f["fc"] + f["lm_head"]
    return {"forward": f["total"], "backward": backward, "total": f["total"] + backward}


def dflash_block_attended_keys(context_per_block: Iterable[int], block_size: int) -> int:
    """Sum of attended keys for blocks that each see ``ctx`` context rows plus their own block.

    DFlash block attention is bidirectional within the block: every one of the
    ``block_size`` slots attends to ``ctx + block_size`` keys.
    """
    return sum(int(block_size) * (int(ctx) + int(block_size)) for ctx in context_per_block)


def sft_step_flops(draft_config, *, seq_len: int, num_anchors: int) -> dict[str, int]:
    """Training FLOPs of SpecForge's DFlash SFT on one sequence of ``seq_len`` tokens.

    SpecForge draws ``num_anchors`` blocks per sequence (fewer when the sequence
    is short); each block's slots see, on average, half the sequence as context
    (anchors uniform over the sequence). Approximation: the attention term uses
    that mean; the matmul terms are exact.
    """
    bs = int(draft_config.block_size)
    blocks = max(0, min(int(num_anchors), int(seq_len) - 1))
    return drafter_training_flops(
        draft_config,
        query_slots=blocks * bs,
        context_rows=int(seq_len),
        attended_keys=blocks * bs * (int(seq_len) // 2 + bs),
        lm_head_slots=blocks * (bs - 1),
    )


def opd_replay_flops(draft_config, anchors: Iterable[int], *, teacher_form: str = "full") -> dict[str, int]:
    """Drafter-side FLOPs of replaying one rollout sequence in the OPD trainer.

    Args:
        draft_config: the drafter's config (block_size, vocabulary).
        anchors: the sequence's anchors a_m (each block sees a_m context rows).
        teacher_form: ``full`` adds the teacher's lm_head forward over the
            bs-1 drafted slots of every block (``2 * H * V`` each); ``topk`` and
            ``token`` carry log-probs in the shard and add nothing.

    Returns:
        dict: ``forward``, ``backward``, ``teacher_lm_head``, ``total`` (ints).
    """
    anchors = [int(a) for a in anchors]
    bs = int(draft_config.block_size)
    M = len(anchors)
    ctx_rows = max(anchors) if anchors else 0
    out = drafter_training_flops(
        draft_config,
        query_slots=M * bs,
        context_rows=ctx_rows,
        attended_keys=dflash_block_attended_keys(anchors, bs),
        lm_head_slots=M * (bs - 1),
    )
    teacher = lm_head_flops(draft_config.hidden_size, draft_config.vocab_size, M * (bs - 1)) if teacher_form == "full" else 0
    out["teacher_lm_head"] = teacher
    out["total"] += teacher
    return out


# ---------------------------------------------------------------------------
# target


def target_forward_flops(target_config, *, tokens: int, attended_keys: int, lm_head_tokens: int) -> int:
    """Forward FLOPs of the target over ``tokens`` new positions.

    ``L * layer_matmuls * tokens + attention(attended_keys) + 2 * H * V * lm_head_tokens``
    (``lm_head_tokens`` is where logits are computed: 1 for a prefill with
    ``logits_to_keep=1``, every slot of a verify step, 0 for a feature capture
    that stops at the hidden states).
    """
    c = _text(target_config)
    L = int(c.num_hidden_layers)
    return (
        L * decoder_layer_matmul_flops_per_token(c) * int(tokens)
        + attention_flops(c, L, attended_keys)
        + lm_head_flops(c.hidden_size, c.vocab_size, lm_head_tokens)
    )


def rollout_target_flops(target_config, *, prompt_len: int, anchors: Iterable[int], block_size: int) -> int:
    """Target FLOPs of one speculative rollout: prefill (causal, logits at the last
    position) plus one ``block_size``-token verify step per anchor (with KV cache,
    slot k attends to ``a_m + k + 1`` keys, logits at every slot)."""
    P = int(prompt_len)
    total = target_forward_flops(target_config, tokens=P, attended_keys=P * (P + 1) // 2, lm_head_tokens=1)
    bs = int(block_size)
    for a in anchors:
        keys = sum(int(a) + k + 1 for k in range(bs))
        total += target_forward_flops(target_config, tokens=bs, attended_keys=keys, lm_head_tokens=bs)
    return total


def capture_target_flops(target_config, *, seq_len: int, with_logits: bool = False) -> int:
    """Target FLOPs of one teacher-forced forward over ``seq_len`` tokens (feature capture)."""
    n = int(seq_len)
    return target_forward_flops(
        target_config, tokens=n, attended_keys=n * (n + 1) // 2, lm_head_tokens=n if with_logits else 0
    )


def autoregressive_target_flops(target_config, *, prompt_len: int, new_tokens: int) -> int:
    """Target FLOPs of plain greedy decoding: prefill + ``new_tokens - 1`` single-token steps."""
    P, N = int(prompt_len), int(new_tokens)
    total = target_forward_flops(target_config, tokens=P, attended_keys=P * (P + 1) // 2, lm_head_tokens=1)
    for i in range(1, N):
        total += target_forward_flops(target_config, tokens=1, attended_keys=P + i, lm_head_tokens=1)
    return total


@dataclass
class FlopsLedger:
    """Cumulative FLOPs of a drafter's training history (stored in checkpoint metadata).

    Attributes (floats, FLOPs; float because totals exceed 2**63 at paper scale):
        drafter_train: drafter forward + backward (SFT and OPD).
        teacher_lm_head: the teacher's lm_head forward on the OPD side (``full`` form).
        target_rollout: target forwards of OPD rollouts.
        target_capture: target forwards capturing features or responses (SFT, recomputation).
    """

    drafter_train: float = 0.0
    teacher_lm_head: float = 0.0
    target_rollout: float = 0.0
    target_capture: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def drafter_budget(self) -> float:
        """The matched-FLOPs budget of the paper: drafter training + the teacher's lm_head."""
        return self.drafter_train + self.teacher_lm_head

    @property
    def target_total(self) -> float:
        return self.target_rollout + self.target_capture

    def add(self, other: "FlopsLedger") -> "FlopsLedger":
        return FlopsLedger(
            self.drafter_train + other.drafter_train,
            self.teacher_lm_head + other.teacher_lm_head,
            self.target_rollout + other.target_rollout,
            self.target_capture + other.target_capture,
            self.notes + [n for n in other.notes if n not in self.notes],
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["drafter_budget"] = self.drafter_budget
        d["target_total"] = self.target_total
        return d

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "FlopsLedger":
        """Read a ledger back from metadata; missing keys are 0; unknown keys are ignored.

        Raises:
            ValueError: a value that is not a non-negative number (names the key).
        """
        d = d or {}
        kw = {}
        for k in ("drafter_train", "teacher_lm_head", "target_rollout", "target_capture"):
            v = d.get(k, 0.0)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"flops metadata: `{k}` must be a non-negative number, got {v!r}")
            kw[k] = float(v)
        return cls(**kw, notes=list(d.get("notes", [])))


def sft_flops(cfg, draft_config, target_config, responses: list, *, steps: int,
              captured_here: bool = True, generated_here: Optional[bool] = None):
    """FLOPs of an SFT run of ``cfg`` (an ``ExperimentConfig``) as a ``FlopsLedger`` (this module's conventions).

    ``responses``: the run's ``ResponseRecord`` list; ``steps``: optimizer steps trained.

    ``drafter_train`` = steps x batch_size x the mean per-sequence cost of SpecForge's
    DFlash SFT (``sft_step_flops`` with ``training.num_anchors``) over the
    training samples. ``target_capture`` = response generation (plain decoding)
    plus the feature capture forward of every sample. ``generated_here`` (default:
    ``captured_here``) and ``captured_here`` say whether this run made the responses and the
    features: a step reused from another run (``sft.reuse_from``, a packed responses step)
    was paid there and is not counted again.
    """
    lens = [len(r.prompt_ids) + len(r.response_ids) for r in responses] or [0]
    per_seq = sum(sft_step_flops(draft_config, seq_len=n, num_anchors=cfg.training.num_anchors)["total"] for n in lens) / len(lens)
    ledger = FlopsLedger(drafter_train=float(per_seq * cfg.training.batch_size * cfg.training.accumulation_steps * steps))
    generated_here = captured_here if generated_here is None else generated_here
    for r in responses:
        if generated_here:
            ledger.target_capture += autoregressive_target_flops(target_config, prompt_len=len(r.prompt_ids), new_tokens=len(r.response_ids))
        if captured_here:
            ledger.target_capture += capture_target_flops(target_config, seq_len=len(r.prompt_ids) + len(r.response_ids))
    return ledger


def opd_replay_ledger(draft_config, records, teacher_form: str, epochs: float) -> FlopsLedger:
    """Drafter-training FLOPs of ``epochs`` passes of the OPD trainer over ``records`` (``RolloutRecord``s;
    ``opd_replay_flops`` per record: forward + backward into ``drafter_train``, the teacher's lm_head apart)."""
    ledger = FlopsLedger()
    for r in records:
        f = opd_replay_flops(draft_config, r.anchors.tolist(), teacher_form=teacher_form)
        ledger.drafter_train += (f["forward"] + f["backward"]) * epochs
        ledger.teacher_lm_head += f["teacher_lm_head"] * epochs
    return ledger
