"""Target-assisted speculative rollout with anchor recording (paper section 4.2; DESIGN.md sections 2-3).

``SpeculativeEngine`` decodes a batch of prompts with the current DFlash drafter
and the target: per block m it drafts bs-1 tokens from the target's context
features, verifies ``[slot 0, d_1..d_{bs-1}]`` in one target forward, accepts
the longest matching prefix r_m plus one bonus token, and records what the OPD
trainer needs (``specforge_opd.records.RolloutRecord``).

Batched cache bookkeeping. Rows accept different counts per step, so the
target's ``DynamicCache`` (and the drafter's) is shared by the batch but each
row owns a boolean ``valid`` map over cache *slots* and every token carries its
own explicit position id. A verify step appends bs slots per row; the cache is
cropped to the batch's longest accepted prefix, and the slots a row rejected
stay as masked holes. Prompts are left-padded the same way (pad slots are
holes). Holes are squeezed out by ``_compact`` when they become most of the
cache. Every target and drafter forward gets a 4-D boolean attention mask built
from that map, so each row sees exactly its own verified prefix: the rollout is
lossless (T=0 equals the target's greedy decoding up to numerical ties).

The drafter's cache holds the projected context features (DFlash attention
keys/values of the target features) at the same slot layout; the features of a
verify step are fed to it at the next draft, as SpecForge's ``spec_generate``
does for one sequence.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from pathlib import Path

import torch

from .adapter import create_dflash_sdpa_mask, extract_context_feature
from .config import RolloutConfig
from .decode import HFCache, TargetRunner
from .records import RolloutRecord

log = logging.getLogger(__name__)


class RolloutError(ValueError):
    """Bad rollout input (empty prompt, prompt too long, drafter/target mismatch); the message says the fix."""


# ---------------------------------------------------------------------------
# sampling


def row_generator(seed: int, sample_id: str, device="cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded from (seed, sample_id), so a row samples the same
    tokens whatever batch it is decoded in."""
    h = hashlib.sha256(f"{int(seed)}:{sample_id}".encode()).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
    return g


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution the decoder samples from: softmax(logits / T), then top-k and top-p filtering.

    Args:
        logits: float [..., V].
        temperature: > 0.
    Returns:
        float32 [..., V] probabilities summing to 1 over the kept tokens.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k and 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        csum = sorted_p.cumsum(-1)
        # keep a token when the mass before it is still below top_p (the first token always stays)
        keep_sorted = (csum - sorted_p) < top_p * csum[..., -1:]
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


def sample_tokens(
    logits: torch.Tensor, generators: Sequence[torch.Generator], temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Pick a token per position: argmax at T=0, else one draw per position from ``sampling_probs``.

    Args:
        logits: float [B, S, V]; row b draws with ``generators[b]`` (inverse-CDF sampling).
    Returns:
        int64 [B, S].
    """
    if temperature <= 0.0:
        return logits.argmax(-1)
    probs = sampling_probs(logits, temperature, top_p, top_k)
    cdf = probs.cumsum(-1)
    out = torch.empty(probs.shape[:2], dtype=torch.long, device=logits.device)
    for b, g in enumerate(generators):
        u = torch.rand(probs.shape[1], generator=g, device=g.device).to(cdf.device) * cdf[b, :, -1]
        out[b] = torch.searchsorted(cdf[b], u.unsqueeze(-1)).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    return out


# ---------------------------------------------------------------------------
# masks and caches


def _step_mask(kv_valid: torch.Tensor, q_valid: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask [B, 1, q, S + q] for q new slots after S cached ones.

    A new slot sees every valid cached slot and the valid new slots at or before
    it. Each slot also sees itself, so a pad/hole query never has an empty row
    (an empty row makes SDPA return NaN, which would then sit in the cache).
    """
    B, S = kv_valid.shape
    q = q_valid.shape[1]
    causal = torch.ones(q, q, dtype=torch.bool, device=kv_valid.device).tril()
    new = causal.unsqueeze(0) & q_valid.unsqueeze(1)
    new = new | torch.eye(q, dtype=torch.bool, device=kv_valid.device).unsqueeze(0)
    old = kv_valid.unsqueeze(1).expand(B, q, S)
    return torch.cat([old, new], dim=2).unsqueeze(1)


def left_pad(prompts: Sequence[Sequence[int]], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of prompts, left-padded: (ids int64 [B, P], valid bool [B, P], positions int64 [B, P]).

    Pad slots hold id 0 and are not valid (holes); each row's positions count its own tokens from 0.
    """
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, P, dtype=torch.long, device=device)
    valid = torch.zeros(B, P, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.as_tensor(list(p), device=device)
        valid[b, P - len(p):] = True
    return ids, valid, (valid.long().cumsum(1) - 1).clamp(min=0)


def prefill(runner, cache, ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor, layer_ids=None, chunk: int = 256):
    """Run left-padded prompts through the target in chunks of ``chunk`` columns, appending to ``cache``.

    No forward sees more than ``chunk`` queries, so no [P, P] mask or score matrix
    is built for a long prompt. Pad slots are holes (``valid`` False).

    Args:
        runner: ``decode.TargetRunner``; cache: its ``new_cache`` (empty).
        ids, pos: int64 [B, P]; valid: bool [B, P].
        layer_ids: decoder layers whose features to return, or None.
    Returns:
        (final-norm hidden of the last column [B, 1, H], features [B, P, n*H] or None).
    Raises:
        ValueError: ``chunk`` < 1 (``target.prefill_chunk``).
    """
    if chunk < 1:
        raise ValueError(f"target.prefill_chunk={chunk}: must be at least 1")
    P = ids.shape[1]
    feats = []
    hidden = None
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        mask = _step_mask(valid[:, :s], valid[:, s:e])
        hidden, f = runner.forward(ids[:, s:e], pos[:, s:e], mask, cache, layer_ids)
        if f is not None:
            feats.append(f)
    return hidden[:, -1:], (torch.cat(feats, dim=1) if feats else None)


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of items grouped into batches of similar length (stable sort by length, then chunks).

    Left padding makes every row of a batch pay for its longest prompt, in the
    prefill and in every step's attention; batching similar lengths removes most
    of it. Sampling is seeded per sample id, so a row's tokens do not depend on
    its batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


# ---------------------------------------------------------------------------
# one-forward helpers (random anchors, tests, trainers that recompute)


@torch.no_grad()
def target_forward(target, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache, layer_ids):
    """One target forward returning (final-norm hidden [B, q, H], context features [B, q, n*H]).

    Features are HF ``hidden_states[k + 1]`` for k in ``layer_ids``, concatenated
    in id order (DESIGN.md, target layer ids). ``attention_mask`` is a 4-D bool
    mask (True = attend) that transformers uses as given.
    """
    out = target.model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=cache is not None,
        output_hidden_states=True,
    )
    return out.last_hidden_state, extract_context_feature(out.hidden_states, layer_ids)


@torch.no_grad()
def verify_blocks(target, input_ids: torch.Tensor, anchors: torch.Tensor, block_tokens: torch.Tensor, layer_ids):
    """Verify M blocks of one sequence in one target forward (block attention mask).

    The context is ``input_ids[:T-1]`` (positions 0..T-2, causal); block m holds
    ``block_tokens[m] = [token at a_m, d_1..d_{bs-1}]`` at positions a_m..a_m+bs-1
    and sees the context strictly before a_m plus its own earlier slots, exactly
    what an incremental verify step at anchor a_m sees.

    Args:
        input_ids: int64 [T]; anchors: int64 [M] in 0..T-1; block_tokens: int64 [M, bs].
    Returns:
        (context features [T-1, n*H], block final-norm hidden [M, bs, H]).
    """
    dev = next(target.parameters()).device
    T = int(input_ids.numel())
    M, bs = block_tokens.shape
    S = T - 1
    ids = torch.cat([input_ids[:S], block_tokens.reshape(-1)]).to(dev).unsqueeze(0)
    offs = torch.arange(bs, device=dev)
    pos = torch.cat([torch.arange(S, device=dev), (anchors.to(dev).unsqueeze(1) + offs).reshape(-1)]).unsqueeze(0)
    Q = S + M * bs
    mask = torch.zeros(Q, Q, dtype=torch.bool, device=dev)
    mask[:S, :S] = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    blk = torch.arange(M * bs, device=dev) // bs
    anc = anchors.to(dev)[blk]
    mask[S:, :S] = torch.arange(S, device=dev).unsqueeze(0) < anc.unsqueeze(1)
    same = blk.unsqueeze(1) == blk.unsqueeze(0)
    mask[S:, S:] = same & torch.ones(M * bs, M * bs, dtype=torch.bool, device=dev).tril()
    hidden, feats = target_forward(target, ids, pos, mask.view(1, 1, Q, Q), None, layer_ids)
    return feats[0, :S], hidden[0, S:].view(M, bs, -1)


@torch.no_grad()
def draft_blocks(drafter, target, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """The drafter's logits for every block of one sequence in one forward (the trainer's replay layout).

    Context = ``features`` rows (positions 0..T-2); block m's input is
    ``[input_ids[a_m], MASK...]`` at positions a_m..a_m+bs-1 and it sees context
    rows < a_m (SpecForge ``create_dflash_sdpa_mask``). Slot k predicts position a_m + k.

    Args:
        input_ids: int64 [T]; features: [T-1, n*H]; anchors: int64 [M].
    Returns:
        float32 logits [M, bs-1, V] for slots 1..bs-1.
    """
    dev = next(target.parameters()).device
    bs = int(drafter.block_size)
    S = int(features.shape[0])
    M = int(anchors.numel())
    anchors = anchors.to(dev)
    noise_ids = torch.full((M, bs), int(mask_token_id), dtype=torch.long, device=dev)
    noise_ids[:, 0] = input_ids.to(dev)[anchors]
    noise = target.model.embed_tokens(noise_ids.view(1, -1))
    pos = torch.cat([torch.arange(S, device=dev), (anchors.unsqueeze(1) + torch.arange(bs, device=dev)).view(-1)]).unsqueeze(0)
    mask = create_dflash_sdpa_mask(anchors.view(1, M), torch.ones(1, M, dtype=torch.bool, device=dev), S, bs, dev)
    ddtype = next(drafter.parameters()).dtype
    out = drafter(
        position_ids=pos,
        noise_embedding=noise.to(ddtype),
        target_hidden=features.to(dev, ddtype).unsqueeze(0),
        attention_mask=mask,
    )
    out = out.view(M, bs, -1)[:, 1:]
    return target.lm_head(out.to(target.lm_head.weight.dtype)).float()


# ---------------------------------------------------------------------------
# the engine


@dataclass
class _Row:
    """Per-sequence bookkeeping while it decodes."""

    sample_id: str
    tokens: list
    prompt_len: int
    gen: Optional[torch.Generator]
    anchors: list
    drafts: list
    accepted: list
    features: list
    teacher: list  # one dict per block
    draft_logits: list
    finished: bool = False
    done: bool = False


class SpeculativeEngine:
    """Batched target-assisted speculative decoding that records a ``RolloutRecord`` per prompt.

    Args:
        target_model: HF causal LM (``.model`` with ``embed_tokens``, ``.lm_head``), eval mode.
        drafter: SpecForge ``DFlashDraftModel`` (block_size, target_layer_ids, mask_token_id in its config).
        rcfg: ``RolloutConfig`` (max_new_tokens, temperature, top_p, top_k, teacher, teacher_topk,
            anchors, store_features, seed).
        stop_token_ids: a sequence ends right after producing one of these.
        mask_token_id: the id the run expects the drafter to use (checked against its config).
        max_context: prompt + max_new_tokens limit in tokens (``target.max_context``); None = the
            target's ``max_position_embeddings``.
        too_long: ``error`` | ``truncate_left`` (keep the prompt's last tokens) | ``skip`` (the
            prompt's id goes to ``self.skipped``; ``generate`` returns records for the rest).
        record_draft_logits: also keep the drafter's logits [M, bs-1, V] in ``record.extra``
            (tests and debugging; not written to shards).
        prefill_chunk: prompts go through the target in chunks of this many tokens
            (``target.prefill_chunk``).

    Raises:
        RolloutError / ``drafter.DrafterError``: drafter and target do not fit (hidden size,
        target layers, vocabulary, mask token), before any decoding.
    """

    def __init__(
        self,
        target_model,
        drafter,
        rcfg: RolloutConfig,
        *,
        stop_token_ids: Sequence[int],
        mask_token_id: int,
        max_context: Optional[int] = None,
        too_long: str = "error",
        record_draft_logits: bool = False,
        prefill_chunk: int = 256,
    ):
        from .drafter import check_compatible

        check_compatible(drafter.config, target_model.config, expected_mask_token_id=int(mask_token_id))
        if getattr(drafter, "sliding_window", None) is not None:
            raise RolloutError("drafters with sliding-window layers are not supported by the embedded rollout; use full_attention layers")
        if too_long not in ("error", "truncate_left", "skip"):
            raise RolloutError(f"target.too_long={too_long!r}: use error, truncate_left or skip")
        self.target = target_model.eval()
        self.drafter = drafter.eval()
        self.rcfg = rcfg
        self.stop_token_ids = {int(t) for t in stop_token_ids}
        self.mask_token_id = int(mask_token_id)
        self.block_size = int(drafter.block_size)
        self.layer_ids = [int(i) for i in drafter.config.dflash_config["target_layer_ids"]]
        tcfg = getattr(target_model.config, "text_config", target_model.config)
        self.max_context = int(max_context or getattr(tcfg, "max_position_embeddings", 1 << 30))
        self.too_long = too_long
        self.record_draft_logits = record_draft_logits
        self.prefill_chunk = int(prefill_chunk)
        #: The target's forward on a preallocated KV cache (``decode.TargetRunner``).
        self.runner = TargetRunner.of(target_model)
        self.device = next(target_model.parameters()).device
        self.skipped: list[str] = []
        #: Squeeze cache holes once the cache has ``compact_min_slots`` slots and the valid
        #: fraction is below ``compact_below`` (holes cost attention time, squeezing costs a copy).
        self.compact_min_slots = 64
        self.compact_below = 0.5
        #: Counters of the last ``generate`` call (verify steps, generated tokens, seconds per phase).
        self.stats: dict = {}

    # -- input checks ------------------------------------------------------

    def _prepare_prompts(self, prompts, sample_ids):
        budget = self.max_context - self.rcfg.max_new_tokens
        if budget <= 0:
            raise RolloutError(
                f"rollout.max_new_tokens={self.rcfg.max_new_tokens} leaves no room for a prompt in "
                f"target.max_context={self.max_context}; lower max_new_tokens or raise max_context"
            )
        kept = []
        self.skipped = []
        for i, p in enumerate(prompts):
            sid = str(sample_ids[i]) if sample_ids is not None else str(i)
            p = [int(t) for t in (p.tolist() if torch.is_tensor(p) else p)]
            if not p:
                raise RolloutError(f"prompt {sid!r} is empty: every prompt needs at least one token (check the chat rendering)")
            if len(p) > budget:
                if self.too_long == "error":
                    raise RolloutError(
                        f"prompt {sid!r} has {len(p)} tokens, more than target.max_context - rollout.max_new_tokens = "
                        f"{budget}; set target.too_long=truncate_left or skip, or shorten it"
                    )
                if self.too_long == "skip":
                    self.skipped.append(sid)
                    continue
                p = p[-budget:]
            kept.append((sid, p))
        return kept

    # -- drafting and verifying (one batch step each) ------------------------

    def _propose(self, cur_tok, cur_pos, ctx_feats, ctx_valid, ctx_pos, rows):
        """Draft one block per active row.

        Feeds the pending context features (slots the drafter's cache lacks) and
        the block ``[cur_tok, MASK...]``; the drafter cache keeps the context
        part only. Returns (drafts int64 [B, bs-1], drafter logits float32 [B, bs-1, V]).
        """
        bs = self.block_size
        B = cur_tok.shape[0]
        dev = self.device
        noise_ids = torch.full((B, bs), self.mask_token_id, dtype=torch.long, device=dev)
        noise_ids[:, 0] = cur_tok
        noise = self.target.model.embed_tokens(noise_ids)
        blk_pos = cur_pos.unsqueeze(1) + torch.arange(bs, device=dev)
        S_d = self.dcache.get_seq_length()
        kv_valid = torch.cat([self.valid[:, :S_d], ctx_valid], dim=1)
        mask = kv_valid.unsqueeze(1).unsqueeze(1).expand(B, 1, bs, kv_valid.shape[1])
        mask = torch.cat([mask, torch.ones(B, 1, bs, bs, dtype=torch.bool, device=dev)], dim=3)
        ddtype = next(self.drafter.parameters()).dtype
        out = self.drafter(
            position_ids=torch.cat([ctx_pos, blk_pos], dim=1),
            noise_embedding=noise.to(ddtype),
            target_hidden=ctx_feats.to(ddtype),
            attention_mask=mask,
            past_key_values=self.dcache.cache,
            use_cache=True,
        )
        self.dcache.crop(S_d + ctx_feats.shape[1])
        logits = self.runner.logits(out[:, 1:]).float()
        return logits.argmax(-1), logits

    def _verify(self, block_ids, block_pos):
        """Run the target on [B, bs] block tokens after the cached slots; returns (hidden, features)."""
        q_valid = torch.ones_like(block_ids, dtype=torch.bool)
        mask = _step_mask(self.valid, q_valid)
        return self.runner.forward(block_ids, block_pos, mask, self.tcache, self.layer_ids)

    def _compact(self):
        """Squeeze the holes out of both caches (same slot layout), keeping each row's slot order."""
        counts = self.valid.sum(1)
        width = int(counts.max())
        B, S = self.valid.shape
        # sort holes first, valid slots last, stable so the valid slots keep their order (left padding)
        key = self.valid.long() * (S + 1) + torch.arange(S, device=self.valid.device)
        order = key.argsort(dim=1)[:, S - width:]
        self.tcache.gather_slots(order)
        self.dcache.gather_slots(order)
        self.valid = torch.gather(self.valid, 1, order)

    # -- the loop ----------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sample_ids: Optional[Sequence[str]] = None, drafter_step: int = 0) -> list[RolloutRecord]:
        """Roll out every prompt; returns one ``RolloutRecord`` per kept prompt, in input order.

        Args:
            prompts: token id lists (no padding), one per prompt.
            sample_ids: ids stored in the records (default "0", "1", ...); they also seed
                each row's sampler, so a row's sample does not depend on its batch.
            drafter_step: stored in every record (policy lag bookkeeping).
        Raises:
            RolloutError: an empty prompt, or a prompt over the context limit with ``too_long=error``.
        """
        import time

        kept = self._prepare_prompts(prompts, sample_ids)
        self.stats = {"verify_steps": 0, "completion_tokens": 0, "t_prefill": 0.0, "t_draft": 0.0, "t_verify": 0.0, "t_other": 0.0}
        if not kept:
            return []
        rc = self.rcfg
        dev = self.device
        bs = self.block_size
        B = len(kept)
        t0 = time.perf_counter()
        rows = [
            _Row(sid, list(p), len(p), row_generator(rc.seed, sid) if rc.temperature > 0 else None, [], [], [], [], [], [])
            for sid, p in kept
        ]
        gens = [r.gen for r in rows]
        self._rows = rows  # visible to _propose overrides (tests' oracle drafters)

        # prefill, left-padded: pad slots are holes
        ids, valid, pos = left_pad([p for _, p in kept], dev)
        P = ids.shape[1]
        # room for the prompt, every token and a block of drafts; the holes that verify steps leave
        # grow it (doubling, rare) until compaction squeezes them
        self.tcache = self.runner.new_cache(B, P + rc.max_new_tokens + 2 * bs)
        self.dcache = HFCache()
        hidden, feats = prefill(self.runner, self.tcache, ids, valid, pos, self.layer_ids, self.prefill_chunk)
        self.valid = valid
        first = sample_tokens(self.runner.logits(hidden).float(), gens, rc.temperature, rc.top_p, rc.top_k)[:, 0]
        for b, r in enumerate(rows):
            r.features.append(feats[b, valid[b]])
            self._append(r, [int(first[b])])
        ctx_feats, ctx_valid, ctx_pos = feats, valid, pos
        cur_tok = first
        cur_pos = torch.tensor([r.prompt_len for r in rows], device=dev)
        self.stats["t_prefill"] = time.perf_counter() - t0

        active = list(range(B))
        # rows that ended on the prefill token leave before the first draft
        keep = [i for i, r in enumerate(rows) if not r.done]
        progress = _progress(total=B * rc.max_new_tokens, disable=B * rc.max_new_tokens < 512)
        while True:
            if len(keep) < len(active):
                sel = torch.tensor(keep, device=dev)
                active = [active[i] for i in keep]
                if not active:
                    break
                self.tcache.select_rows(sel)
                self.dcache.select_rows(sel)
                self.valid = self.valid[sel]
                ctx_feats, ctx_valid, ctx_pos = ctx_feats[sel], ctx_valid[sel], ctx_pos[sel]
                cur_tok, cur_pos = cur_tok[sel], cur_pos[sel]
                gens = [gens[i] for i in keep]
            t1 = time.perf_counter()
            drafts, dlogits = self._propose(cur_tok, cur_pos, ctx_feats, ctx_valid, ctx_pos, active)
            t2 = time.perf_counter()
            if self.valid.shape[1] >= self.compact_min_slots and self.valid.float().mean() < self.compact_below:
                self.stats["compactions"] = self.stats.get("compactions", 0) + 1
                self._compact()
            block_ids = torch.cat([cur_tok.unsqueeze(1), drafts], dim=1)
            block_pos = cur_pos.unsqueeze(1) + torch.arange(bs, device=dev)
            S = self.valid.shape[1]
            hidden, feats = self._verify(block_ids, block_pos)
            t3 = time.perf_counter()
            logits = self.runner.logits(hidden).float()
            posterior = sample_tokens(logits, gens, rc.temperature, rc.top_p, rc.top_k)
            acc = (drafts == posterior[:, :-1]).long().cumprod(1).sum(1)
            teacher = self._teacher(hidden[:, : bs - 1], logits[:, : bs - 1], drafts)
            keep = []
            n_new = 0
            for j, b in enumerate(active):
                r = rows[b]
                rj = int(acc[j])
                r.anchors.append(int(cur_pos[j]))
                r.drafts.append(drafts[j])
                r.teacher.append({k: v[j] for k, v in teacher.items()})
                if self.record_draft_logits:
                    r.draft_logits.append(dlogits[j])
                new = drafts[j, :rj].tolist() + [int(posterior[j, rj])]
                r.features.append(feats[j, : rj + 1])
                n_new += self._append(r, new, block=rj)
                if not r.done:
                    keep.append(j)
            progress.update(n_new)
            self.stats["verify_steps"] += len(active)
            self.stats["batch_steps"] = self.stats.get("batch_steps", 0) + 1
            # keep the batch's longest accepted prefix; shorter rows get holes
            c = int(acc.max()) + 1
            self.tcache.crop(S + c)
            self.valid = torch.cat([self.valid, torch.arange(c, device=dev).unsqueeze(0) <= acc.unsqueeze(1)], dim=1)
            ctx_feats, ctx_valid, ctx_pos = feats[:, :c], self.valid[:, S:], block_pos[:, :c]
            cur_tok = posterior.gather(1, acc.unsqueeze(1)).squeeze(1)
            cur_pos = cur_pos + acc + 1
            t4 = time.perf_counter()
            self.stats["t_draft"] += t2 - t1
            self.stats["t_verify"] += t3 - t2
            self.stats["t_other"] += t4 - t3
        progress.close()
        self.tcache = self.dcache = self._rows = None

        records = [self._finish(r, drafter_step) for r in rows]
        if rc.anchors == "random":
            records = [self._random_anchors(rec) for rec in records]
        if not rc.store_features:
            for rec in records:
                rec.features = None
        self.stats["completion_tokens"] = sum(rec.completion_tokens for rec in records)
        self.stats["seconds"] = time.perf_counter() - t0
        return records

    def _append(self, row: _Row, new: list[int], block: Optional[int] = None) -> int:
        """Add verified tokens to a row, stopping at a stop token or the max_new_tokens budget.

        When the sequence ends inside a block, that block's accepted count is
        clipped to the tokens kept, so ``a_M + r_M + 1 <= T`` and every accepted
        slot has its token in ``input_ids``. Returns the number of tokens added.
        """
        room = self.rcfg.max_new_tokens - (len(row.tokens) - row.prompt_len)
        added = 0
        for t in new[: max(room, 0)]:
            row.tokens.append(int(t))
            added += 1
            if int(t) in self.stop_token_ids:
                row.finished = True
                break
        row.done = row.finished or len(row.tokens) - row.prompt_len >= self.rcfg.max_new_tokens
        if block is not None:
            # ``added`` tokens follow the anchor; a block cut short keeps only those as accepted
            row.accepted.append(min(block, added))
        return added

    def _teacher(self, hidden, logits, drafts) -> dict:
        """Teacher signal at verify slots 0..bs-2 (predicting drafted slots 1..bs-1), temperature 1, unfiltered."""
        form = self.rcfg.teacher
        if form == "full":
            return {"teacher_hidden": hidden}
        logp = torch.log_softmax(logits, dim=-1)
        out = {"teacher_draft_logprob": logp.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)}
        if form == "topk":
            k = min(self.rcfg.teacher_topk, logp.shape[-1])
            top = torch.topk(logp, k, dim=-1)
            out["teacher_topk_ids"] = top.indices
            out["teacher_topk_logprobs"] = top.values
        return out

    def _finish(self, r: _Row, drafter_step: int) -> RolloutRecord:
        bs = self.block_size
        M = len(r.anchors)
        T = len(r.tokens)
        feats = torch.cat(r.features, dim=0)[: T - 1].cpu()
        rec = RolloutRecord(
            sample_id=r.sample_id,
            input_ids=torch.tensor(r.tokens, dtype=torch.long),
            prompt_len=r.prompt_len,
            anchors=torch.tensor(r.anchors, dtype=torch.long),
            drafts=torch.stack(r.drafts).cpu() if M else torch.zeros(0, bs - 1, dtype=torch.long),
            accepted=torch.tensor(r.accepted, dtype=torch.long),
            features=feats,
            finished=r.finished,
            drafter_step=int(drafter_step),
        )
        for name in ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logprobs", "teacher_draft_logprob"):
            if M and name in r.teacher[0]:
                setattr(rec, name, torch.stack([t[name] for t in r.teacher]).cpu())
            elif not M and (name in self._teacher_names()):
                setattr(rec, name, self._empty_teacher(name))
        if self.record_draft_logits:
            rec.extra["draft_logits"] = torch.stack(r.draft_logits).cpu() if M else None
        rec.validate()
        return rec

    def _teacher_names(self):
        return {
            "full": ("teacher_hidden",),
            "topk": ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_draft_logprob"),
            "token": ("teacher_draft_logprob",),
        }[self.rcfg.teacher]

    def _empty_teacher(self, name):
        bs = self.block_size
        H = self.target.lm_head.weight.shape[1]
        k = min(self.rcfg.teacher_topk, self.target.lm_head.weight.shape[0])
        return {
            "teacher_hidden": torch.zeros(0, bs - 1, H, dtype=self.target.lm_head.weight.dtype),
            "teacher_topk_ids": torch.zeros(0, bs - 1, k, dtype=torch.long),
            "teacher_topk_logprobs": torch.zeros(0, bs - 1, k),
            "teacher_draft_logprob": torch.zeros(0, bs - 1),
        }[name]

    @torch.no_grad()
    def _random_anchors(self, rec: RolloutRecord) -> RolloutRecord:
        """The random-anchor ablation: redraft and reverify M blocks at uniform positions of the response.

        Anchors are drawn without replacement from [prompt_len, T-1] (seeded by
        rollout.seed and the sample id); drafts come from the drafter's one-forward
        replay layout, acceptance and teacher from one target forward over all
        blocks (``verify_blocks``); the acceptance rule is the rollout's (argmax at T=0,
        the target's seeded sample at T>0). ``extra['anchors'] = 'random'``.
        """
        M = rec.num_blocks
        T = int(rec.input_ids.numel())
        if M == 0:
            return rec
        g = row_generator(self.rcfg.seed + 1, rec.sample_id)
        cand = torch.arange(rec.prompt_len, T)
        anchors = cand[torch.randperm(cand.numel(), generator=g)[:M]].sort().values
        dlogits = draft_blocks(self.drafter, self.target, rec.input_ids, rec.features, anchors, self.mask_token_id)
        drafts = dlogits.argmax(-1).cpu()
        block = torch.cat([rec.input_ids[anchors].unsqueeze(1), drafts], dim=1)
        _, hidden = verify_blocks(self.target, rec.input_ids, anchors, block, self.layer_ids)
        logits = self.target.lm_head(hidden).float()
        post = sample_tokens(logits, [row_generator(self.rcfg.seed + 2, rec.sample_id)] * M, self.rcfg.temperature, self.rcfg.top_p, self.rcfg.top_k).cpu()
        acc = (drafts == post[:, :-1]).long().cumprod(1).sum(1)
        teacher = self._teacher(hidden[:, :-1], logits[:, :-1], drafts.to(logits.device))
        rec.anchors, rec.drafts, rec.accepted = anchors, drafts, acc
        rec.teacher_hidden = rec.teacher_topk_ids = rec.teacher_topk_logprobs = rec.teacher_draft_logprob = None
        for k, v in teacher.items():
            setattr(rec, k, v.cpu())
        rec.extra["anchors"] = "random"
        if self.record_draft_logits:
            rec.extra["draft_logits"] = dlogits.cpu()
        rec.validate()
        return rec


def _progress(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="rollout tokens", unit="tok", disable=disable or not sys.stderr.isatty(), leave=False)


# ---------------------------------------------------------------------------
# plain decoding (the lossless reference and the speedup baseline)


@torch.no_grad()
def autoregressive_generate(
    target_model,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    sample_ids: Optional[Sequence[str]] = None,
    stats: Optional[dict] = None,
    prefill_chunk: int = 256,
) -> list[list[int]]:
    """Batched token-by-token decoding on a preallocated KV cache (left-padded prompts, explicit positions).

    Sampling uses the same per-row generators as ``SpeculativeEngine`` (seeded
    by ``seed`` and the sample id, default "0", "1", ...). A row that finishes
    leaves the batch (its cache rows are dropped), so the rest decode at the
    cost of the rows still running. Prompts are prefilled in chunks of
    ``prefill_chunk`` tokens (``target.prefill_chunk``).

    Returns:
        per prompt, the generated tokens only (at most ``max_new_tokens``, ending
        at the first stop token), in input order.
    ``stats``, when given, receives ``t_prefill``, ``t_decode`` (seconds),
    ``decode_steps`` (batch forwards after the prefill) and ``decode_tokens``
    (tokens those forwards produced, rows still running summed).

    Raises:
        RolloutError: an empty prompt.
    """
    import time

    dev = next(target_model.parameters()).device
    B = len(prompts)
    if B == 0:
        return []
    sids = [str(s) for s in sample_ids] if sample_ids is not None else [str(i) for i in range(B)]
    for sid, p in zip(sids, prompts):
        if len(p) == 0:
            raise RolloutError(f"prompt {sid!r} is empty: every prompt needs at least one token")
    if max_new_tokens <= 0:
        if stats is not None:
            stats.update(t_prefill=0.0, t_decode=0.0, decode_steps=0, decode_tokens=0)
        return [[] for _ in range(B)]
    gens = [row_generator(seed, s) if temperature > 0 else None for s in sids]
    stops = {int(t) for t in stop_token_ids}
    ids, valid, pos = left_pad(prompts, dev)
    P = ids.shape[1]
    runner = TargetRunner.of(target_model)
    cache = runner.new_cache(B, P + max_new_tokens)
    out: list[list[int]] = [[] for _ in range(B)]
    active = list(range(B))  # input index of each batch row still decoding
    t0 = time.perf_counter()
    h, _ = prefill(runner, cache, ids, valid, pos, None, prefill_chunk)
    kv_valid = valid
    cur = pos[:, -1]
    t_first = None
    steps = n_tok = 0
    while True:
        tok = sample_tokens(runner.logits(h[:, -1:]).float(), gens, temperature, top_p, top_k)[:, 0]
        keep = []
        for j, b in enumerate(active):
            out[b].append(int(tok[j]))
            if not (int(tok[j]) in stops or len(out[b]) >= max_new_tokens):
                keep.append(j)
        if t_first is None:
            t_first = time.perf_counter()
        if not keep:
            break
        if len(keep) < len(active):
            sel = torch.tensor(keep, device=dev)
            cache.select_rows(sel)
            kv_valid, cur, tok = kv_valid[sel], cur[sel], tok[sel]
            active = [active[j] for j in keep]
            gens = [gens[j] for j in keep]
        cur = cur + 1
        q_valid = torch.ones(len(active), 1, dtype=torch.bool, device=dev)
        h, _ = runner.forward(tok.unsqueeze(1), cur.unsqueeze(1), _step_mask(kv_valid, q_valid), cache)
        kv_valid = torch.cat([kv_valid, q_valid], dim=1)
        steps += 1
        n_tok += len(active)
    if stats is not None:
        t1 = time.perf_counter()
        stats.update(t_prefill=t_first - t0, t_decode=t1 - t_first, decode_steps=steps, decode_tokens=n_tok)
    return out


# ---------------------------------------------------------------------------
# CLI


def cli(argv: list[str]) -> int:
    """``specforge-opd rollout -c CFG [overrides] --out DIR``: one rollout pass over the prompt pool to shards."""
    from .cli import experiment_parser, parse_experiment

    parser = experiment_parser("rollout", "one speculative rollout pass to shards")
    parser.add_argument("--drafter-step", type=int, default=0, help="optimizer step of the drafter (stored in shards)")
    args, cfg = parse_experiment(parser, argv)
    return run_rollout(cfg, out_dir=cfg.output.dir, drafter_step=args.drafter_step)


def run_rollout(cfg, out_dir, drafter_step: int = 0, prompts=None) -> int:
    """Load target, drafter and prompts from ``cfg``, roll out every prompt, write shards to ``out_dir``.

    Raises:
        RolloutError: no drafter path (draft.path) or a bad prompt.
    """
    from .drafter import drafter_mask_token_id, load_drafter
    from .shards import ShardWriter
    from .target import load_target

    if cfg.draft.path is None:
        raise RolloutError("draft.path is not set: pass the drafter to roll out with (draft.path=DIR)")
    bundle = load_target(cfg.target)
    drafter = load_drafter(cfg.resolve_path(cfg.draft.path), target_config=bundle.model.config, target_dtype=cfg.target.dtype)
    drafter = drafter.to(next(bundle.model.parameters()).device)
    mask = cfg.draft.mask_token_id if cfg.draft.mask_token_id is not None else drafter_mask_token_id(drafter)
    stops = sorted(set(bundle.stop_token_ids) | set(cfg.target.stop_token_ids))
    engine = SpeculativeEngine(
        bundle.model, drafter, cfg.rollout, stop_token_ids=stops, mask_token_id=mask,
        max_context=cfg.target.max_context, too_long=cfg.target.too_long, prefill_chunk=cfg.target.prefill_chunk,
    )
    if prompts is None:
        from .chat import render_prompt
        from .prompts import training_pool

        pool = training_pool(cfg.data, tokenizer=bundle.tokenizer)
        prompts = []
        for pr in pool:
            text = render_prompt(bundle.tokenizer, pr.chat_messages(), thinking=cfg.target.thinking, system_prompt=cfg.target.system_prompt)
            prompts.append((str(pr.id), bundle.tokenizer(text, add_special_tokens=False)["input_ids"]))
    meta = {
        "target_identity": bundle.identity,
        "drafter_identity": str(cfg.draft.path),
        "drafter_step": int(drafter_step),
        "block_size": engine.block_size,
        "target_layer_ids": engine.layer_ids,
        "mask_token_id": mask,
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "top_k": cfg.rollout.top_k,
        "seed": cfg.rollout.seed,
        "teacher": cfg.rollout.teacher,
        "anchors": cfg.rollout.anchors,
        "features": cfg.rollout.store_features,
        "thinking": cfg.target.thinking,
        "target_dtype": cfg.target.dtype,
    }
    writer = ShardWriter(out_dir, meta)
    if cfg.rollout.backend != "embedded":
        from .sglang.rollout_backend import sglang_rollout

        n = sglang_rollout(cfg, bundle, drafter, prompts, writer, drafter_step=drafter_step,
                           draft_path=str(cfg.resolve_path(cfg.draft.path)), out_dir=Path(out_dir))
        print(f"rollout ({cfg.rollout.backend}): {n} sequences -> {out_dir}")
        return 0
    per = cfg.rollout.sequences_per_shard
    pending: list[RolloutRecord] = []
    steps = toks = 0
    skipped = 0
    bsz = cfg.rollout.batch_size
    from tqdm import tqdm

    for idx in tqdm(length_batches([len(p) for _, p in prompts], bsz), desc="rollout batches", unit="batch"):
        chunk = [prompts[i] for i in idx]
        recs = engine.generate([p for _, p in chunk], [s for s, _ in chunk], drafter_step=drafter_step)
        skipped += len(engine.skipped)
        for rec in recs:
            steps += rec.num_blocks
            toks += rec.completion_tokens
        pending.extend(recs)
        while len(pending) >= per:
            writer.write(pending[:per])
            pending = pending[per:]
    if pending:
        writer.write(pending)
    tau = toks / steps if steps else 0.0
    print(f"rollout: {len(prompts) - skipped} sequences, {toks} completion tokens, {steps} verify steps, tau={tau:.3f}, "
          f"{skipped} skipped (too long) -> {out_dir}")
    return 0
