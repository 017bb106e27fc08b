"""Exact offline replay at temperature 0: the target's cached greedy trajectories and a drafter's tau on them.

At T=0 the verified output of speculative decoding is the target's greedy output
whatever the drafter proposes. So the target's greedy trajectory and its context
features at the drafter's layer ids are computed once per (target identity,
rendered prompt, max_new_tokens, stop tokens) and cached as safetensors
(``TrajectoryCache``); the tau of any drafter then follows from replaying its
drafting steps against the cached trajectory (``offline_tau``): anchor
a_0 = prompt_len; the block at a_m is drafted from the context features of
positions < a_m (drafter KV cache, as SpecForge's ``spec_generate``); r_m = longest
prefix of the drafts equal to the cached tokens at a_m+1..; a_{m+1} = a_m + r_m + 1
(DESIGN.md, anchors). No target forward.

Stopping rule, shared with the live engine and SGLang: a sequence ends once it
holds ``max_new_tokens`` completion tokens (the prefill token counts) or a stop
token. ``specforge_opd.eval.evaluate`` (the evaluation tables), ``eval.validation``
(the SFT and OPD validation curves) and ``eval.ngram`` (the prompt-lookup row) replay here.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save

from specforge_opd.atomic import atomic_write_bytes
from specforge_opd.errors import UserError
from specforge_opd.models.drafter import drafter_layer_ids, drafter_mask_token_id
from specforge_opd.models.grouped_attention import grouped_attention
from specforge_opd.progress import progress_bar
from specforge_opd.rollout.decode import TargetRunner, capture
from specforge_opd.rollout.engine import autoregressive_generate
from specforge_opd.rollout.records import RolloutRecord

CACHE_VERSION = 1
#: The trajectory cache fills this many continuous batches' worth of prompts between stores
#: (longer chunks keep the batch full for longer; each stored chunk survives a kill).
FILL_CHUNK_BATCHES = 4
#: Rows per lm_head chunk when the trajectory cache computes top-2 logit gaps.
GAP_CHUNK = 256
#: Trajectories replayed in lockstep together (offline_tau): their contexts pad to the group's longest.
REPLAY_GROUP = 64


class EvalError(UserError, ValueError):
    """Evaluation input is wrong (dataset, prompts, drafter); the message names it and the fix."""


# ---------------------------------------------------------------------------
# the target's greedy trajectories (cached)


@dataclass
class Trajectory:
    """The target's greedy continuation of one prompt, with its context features.

    Attributes:
        input_ids: int64 [T], prompt + greedy response (truncated after the first
            stop token or at ``max_new_tokens`` completion tokens).
        prompt_len: P, the number of prompt tokens (a_0 = P).
        features: {layer_id: [T-1, H]} in the target's dtype; row i is the output of
            decoder layer ``layer_id`` (HF ``hidden_states[layer_id + 1]``) at position i.
        top2_gap: float32 [T-1]; the target's top-1 minus top-2 logit at position i
            (the prediction of token i+1), from the teacher-forced forward; used for
            the numerical-ties allowance (DESIGN.md).
        finished: the response ends with a stop token.
    """

    input_ids: torch.Tensor
    prompt_len: int
    features: dict[int, torch.Tensor]
    top2_gap: torch.Tensor
    finished: bool

    def context(self, layer_ids: Sequence[int]) -> torch.Tensor:
        """Concatenated features [T-1, n*H] in ``layer_ids`` order (DESIGN.md, target layer ids)."""
        return torch.cat([self.features[i] for i in layer_ids], dim=-1)


def _greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, stop_token_ids: Sequence[int],
                     batch_size: Optional[int] = None) -> list[list[int]]:
    """The target's greedy response tokens per prompt, by the decoder live evaluation's baseline uses
    (a continuous batch of ``batch_size`` rows; None: all at once)."""
    outs = autoregressive_generate(model, prompts, max_new_tokens, list(stop_token_ids), temperature=0.0, seed=0,
                                   batch_size=batch_size)
    return [_cut(list(o), max_new_tokens, stop_token_ids) for o in outs]


def _cut(tokens: list[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in stop_token_ids:
            return tokens[: i + 1]
    return tokens


def _atomic_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    """Write safetensors to a temporary name, fsync, rename: a crash never leaves a torn cache entry."""
    data = save({k: v.contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    atomic_write_bytes(path, data)


class TrajectoryCache:
    """Greedy trajectories + features of one target, keyed by a hash, stored as safetensors.

    The key covers the target identity, dtype and device type, the prompt token
    ids (hence the chat template and thinking setting), ``max_new_tokens`` and
    the stop tokens. One
    file per key holds every layer any evaluated drafter asked for; a drafter
    needing another layer triggers one teacher-forced target forward and the
    file is rewritten (atomically) with the union.
    """

    def __init__(self, root: Optional[os.PathLike], target_model, target_identity: str, *, max_new_tokens: int,
                 stop_token_ids: Sequence[int], batch_size: int = 8):
        self.root = Path(root) if root is not None else None
        self.batch_size = int(batch_size)
        self.model = target_model
        self.identity = str(target_identity)
        self.max_new_tokens = int(max_new_tokens)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        #: Target forwards spent filling the cache (greedy steps are not counted separately).
        self.target_calls = 0
        self._dtype = str(next(target_model.parameters()).dtype).replace("torch.", "")

    def key(self, prompt_ids: Sequence[int]) -> str:
        payload = json.dumps(
            # dtype and device type too: a bf16 GPU trajectory is not an fp32 CPU one
            {"v": CACHE_VERSION, "target": self.identity, "dtype": str(self.model.dtype), "device": self.model.device.type,
             "prompt": list(map(int, prompt_ids)),
             "max_new_tokens": self.max_new_tokens, "stop": self.stop_token_ids},
            separators=(",", ":"),
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    def _path(self, key: str) -> Optional[Path]:
        return self.root / f"{key}.safetensors" if self.root is not None else None

    def _load(self, key: str) -> Optional[Trajectory]:
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                t = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # a torn or foreign file is recomputed, never trusted
            print(f"warning: trajectory cache entry {path} unreadable ({e}); recomputing", file=sys.stderr)
            return None
        if meta.get("target") != self.identity or int(meta.get("version", -1)) != CACHE_VERSION:
            return None
        if meta.get("target_dtype", self._dtype) != self._dtype:
            raise EvalError(f"trajectory cache entry {path} holds a {meta['target_dtype']} target's trajectory, this target is "
                            f"{self._dtype}; point eval.cache_dir elsewhere or delete the entry")
        feats = {int(k.split("_", 1)[1]): v for k, v in t.items() if k.startswith("layer_")}
        return Trajectory(t["input_ids"], int(meta["prompt_len"]), feats, t["top2_gap"], meta["finished"] == "1")

    def _save(self, key: str, tr: Trajectory) -> None:
        path = self._path(key)
        if path is None:
            return
        tensors = {"input_ids": tr.input_ids, "top2_gap": tr.top2_gap}
        tensors.update({f"layer_{i}": v for i, v in tr.features.items()})
        meta = {"version": str(CACHE_VERSION), "target": self.identity, "target_dtype": self._dtype, "prompt_len": str(tr.prompt_len),
                "finished": "1" if tr.finished else "0", "max_new_tokens": str(self.max_new_tokens)}
        _atomic_save(tensors, meta, path)

    @torch.inference_mode()
    def _capture(self, input_ids: torch.Tensor, layer_ids: Iterable[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """One teacher-forced forward over positions 0..T-2 (the last token is never fed to the target).

        Through the target's runner (``decode.capture``): the requested layers only, and the
        top-2 logit gap from the final hidden states ``GAP_CHUNK`` rows at a time, so no
        [T, V] logits tensor or all-layer hidden states are held.
        """
        self.target_calls += 1
        layer_ids = [int(i) for i in layer_ids]
        runner = TargetRunner.of(self.model)
        ((f, h),) = capture(runner, [input_ids[:-1].tolist()], layer_ids, hidden=True)
        H = h.shape[-1]
        feats = {i: f[:, k * H:(k + 1) * H].cpu() for k, i in enumerate(layer_ids)}
        gaps = []
        for s in range(0, h.shape[0], GAP_CHUNK):
            top2 = runner.logits(h[s:s + GAP_CHUNK]).float().topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
        return feats, torch.cat(gaps).cpu()

    def get(self, prompts: list[list[int]], layer_ids: Iterable[int], desc: str = "target trajectories") -> list[Trajectory]:
        """Trajectories for ``prompts`` holding at least ``layer_ids``; computes and stores what is missing.

        Missing trajectories are decoded in prompt order, ``FILL_CHUNK_BATCHES * batch_size``
        prompts per chunk in a continuous batch of ``batch_size`` rows, and each chunk is
        stored before the next starts, so an interrupted fill resumes.
        """
        layer_ids = sorted({int(i) for i in layer_ids})
        keys = [self.key(p) for p in prompts]
        found = [self._load(k) for k in keys]
        todo = [i for i, tr in enumerate(found) if tr is None]
        # chunks of FILL_CHUNK_BATCHES batches, each one continuous batch of batch_size rows, stored before the next
        per = self.batch_size * FILL_CHUNK_BATCHES
        chunks = progress_bar(len(todo), desc, "prompt", disable=not todo, leave=False)
        for s in range(0, len(todo), per):
            chunk = todo[s:s + per]
            self.target_calls += 1
            gens = _greedy_generate(self.model, [prompts[i] for i in chunk], self.max_new_tokens, self.stop_token_ids,
                                    batch_size=self.batch_size)
            for i, gen in zip(chunk, gens):
                ids = torch.tensor(list(prompts[i]) + gen, dtype=torch.long)
                finished = bool(gen) and gen[-1] in self.stop_token_ids
                found[i] = self._complete(keys[i], Trajectory(ids, len(prompts[i]), {}, torch.zeros(0), finished), layer_ids)
            chunks.update(len(chunk))
        chunks.close()
        return [self._complete(k, tr, layer_ids) for k, tr in zip(keys, found)]

    def _complete(self, key: str, tr: Trajectory, layer_ids: list[int]) -> Trajectory:
        """Add missing layers (and the top-2 gaps) with one teacher-forced forward, then store."""
        missing = [l for l in layer_ids if l not in tr.features]
        if missing or tr.top2_gap.numel() != tr.input_ids.numel() - 1:
            feats, gap = self._capture(tr.input_ids, sorted(set(missing) | set(tr.features)))
            tr.features.update(feats)
            tr.top2_gap = gap
            self._save(key, tr)
        return tr


# ---------------------------------------------------------------------------
# exact offline replay


class _ContextKV:
    """Stands in for the drafter's KV cache: per layer, the context keys/values [B, nkv, S, hd].

    The drafter's attention calls ``update(k, v, layer_idx, cache_kwargs)`` with
    the keys/values of the rows it was given and attends to what it returns. In
    ``capture`` mode it keeps them (one full-context forward fills it); otherwise
    it returns the stored context with the block's keys/values appended, storing
    nothing (each block sees its context and itself only).
    """

    def __init__(self, keys=None, values=None, capture: bool = False):
        self.keys, self.values, self.capture = keys or {}, values or {}, capture

    def update(self, k, v, layer_idx, cache_kwargs=None):
        if self.capture:
            self.keys[layer_idx], self.values[layer_idx] = k, v
            return k, v
        return torch.cat([self.keys[layer_idx], k], dim=2), torch.cat([self.values[layer_idx], v], dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if layer_idx not in self.keys else int(self.keys[layer_idx].shape[2])


class _Replay:
    """One prompt's replay state: trajectory, anchor, blocks so far, its context keys/values."""

    def __init__(self, traj: Trajectory, sample_id: str):
        self.traj, self.sample_id = traj, sample_id
        self.ids = traj.input_ids.tolist()
        self.E = len(self.ids)
        self.a = traj.prompt_len
        self.keys: dict[int, Optional[torch.Tensor]] = {}  # layer -> [nkv, E-1, hd], RoPE applied; None once padded
        self.values: dict[int, Optional[torch.Tensor]] = {}
        self.anchors: list[int] = []
        self.drafts: list[torch.Tensor] = []
        self.accepted: list[int] = []

    @property
    def done(self) -> bool:
        # a == E-1: the trajectory's last token is already produced (as a bonus or the prefill token)
        return self.a >= self.E - 1

    def record(self, bs: int) -> RolloutRecord:
        M = len(self.anchors)
        return RolloutRecord(
            sample_id=self.sample_id,
            input_ids=self.traj.input_ids.clone(),
            prompt_len=self.traj.prompt_len,
            anchors=torch.tensor(self.anchors, dtype=torch.long),
            drafts=torch.stack(self.drafts) if M else torch.zeros((0, bs - 1), dtype=torch.long),
            accepted=torch.tensor(self.accepted, dtype=torch.long),
            finished=self.traj.finished,
            extra={"offline": True},
        )


def _context_kv(drafter, embed, st: _Replay, layer_ids, mask: int, dtype, device) -> None:
    """Every drafter layer's context keys/values for positions 0..E-2, in one forward.

    A DFlash layer projects the same context rows (``hidden_norm(fc(features))``)
    whatever the block, so the keys/values a KV cache would accumulate block by
    block (``spec_generate``) are computed here once; a block at a_m then uses
    the first a_m of them.
    """
    ctx = st.traj.context(layer_ids).to(device=device, dtype=dtype)  # [E-1, n*H]
    n = ctx.shape[0]
    bs = int(drafter.block_size)
    cap = _ContextKV(capture=True)
    block = torch.full((1, bs), mask, dtype=torch.long, device=device)
    drafter(
        target_hidden=ctx.unsqueeze(0),
        noise_embedding=embed(block).to(dtype),
        position_ids=torch.arange(n + bs, device=device).unsqueeze(0),
        past_key_values=cap,
        use_cache=True,
        is_causal=False,
    )
    st.keys = {l: k[0, :, :n] for l, k in cap.keys.items()}
    st.values = {l: v[0, :, :n] for l, v in cap.values.items()}


@torch.inference_mode()
def offline_tau(
    drafter,
    target_model,
    trajectories: list[Trajectory],
    sample_ids: Optional[list[str]] = None,
    *,
    full_drafts: bool = False,
    desc: str = "offline replay",
) -> list[RolloutRecord]:
    """Replay ``drafter``'s speculative decoding at T=0 against cached greedy trajectories.

    Per block: the drafter runs [slot 0 = token at a_m, MASK x (bs-1)] at
    positions a_m..a_m+bs-1 over the context of positions < a_m (as SpecForge's
    ``spec_generate`` with its KV cache); drafts = argmax of the target's lm_head
    at slots 1..bs-1 (slot k predicts position a_m + k, DESIGN.md block layout);
    r_m = the longest prefix equal to the cached tokens, clipped to the tokens
    the trajectory has (as the live engine clips the block that ends a
    sequence); a_{m+1} = a_m + r_m + 1. No target forward.

    Cost: the context keys/values of each trajectory are computed once
    (``_context_kv``) and padded once per group of ``REPLAY_GROUP`` trajectories of
    similar length; a group's prompts then advance in lockstep, one block each per
    round, in one batched drafter forward (contexts right-padded, masked; grouped-query
    attention without repeating the keys, ``models.grouped_attention``) and a
    chunked lm_head (slots 1, 2-3, 4-7, ...) that stops, per prompt, after the
    chunk holding the first mismatch: later slots cannot change the verdict.

    Args:
        drafter: ``DFlashDraftModel`` (eval mode).
        target_model: the HF target; only its input embedding and lm_head are used.
        trajectories: from ``TrajectoryCache.get``, holding the drafter's layer ids.
        sample_ids: stored in the records (default "0", "1", ...).
        full_drafts: compute every slot's draft (the full lm_head per block).

    Returns:
        One RolloutRecord per trajectory: input_ids = the trajectory, anchors [M],
        accepted [M], drafts [M, bs-1] int64 with -1 at slots not computed,
        ``extra["offline"] = True``. Pool with ``records.tau_of``.
    """
    sample_ids = sample_ids or [str(i) for i in range(len(trajectories))]
    drafter.eval()
    layer_ids = drafter_layer_ids(drafter)
    bs = int(drafter.block_size)
    mask_id = drafter_mask_token_id(drafter)
    dtype = next(drafter.parameters()).dtype
    device = next(drafter.parameters()).device
    embed = target_model.get_input_embeddings()
    w = target_model.get_output_embeddings().weight
    states = [_Replay(tr, sid) for tr, sid in zip(trajectories, sample_ids)]
    total = sum(s.E - 1 - s.a for s in states)
    bar = progress_bar(total, desc, "tok", disable=total < 2048, leave=False)
    # longest first, in groups of similar length: a group's contexts pad to its own longest
    order = sorted((i for i, s in enumerate(states) if not s.done), key=lambda i: -states[i].E)
    with grouped_attention(drafter):
        for g in range(0, len(order), REPLAY_GROUP):
            group = [states[i] for i in order[g:g + REPLAY_GROUP]]
            for s in group:
                _context_kv(drafter, embed, s, layer_ids, mask_id, dtype, device)
            _replay_group(drafter, embed, w, group, bs, mask_id, dtype, device, full_drafts, bar)
    bar.close()
    return [s.record(bs) for s in states]


def _padded_context(group: list[_Replay], n_layers: int) -> tuple[dict, dict]:
    """Per layer, the group's context keys/values right-padded to its longest: {layer: [n, nkv, S, hd]}
    in the drafter's dtype (zeros past each row's context, masked in the attention). Releases the
    per-trajectory copies (``_Replay.keys``/``values`` become None): the padded copy is the only one kept."""
    keys, values = {}, {}
    S = max(s.keys[0].shape[1] for s in group)
    for l in range(n_layers):
        k0 = group[0].keys[l]
        keys[l] = k0.new_zeros((len(group), k0.shape[0], S, k0.shape[2]))
        values[l] = k0.new_zeros((len(group), k0.shape[0], S, k0.shape[2]))
        for i, s in enumerate(group):
            keys[l][i, :, : s.keys[l].shape[1]] = s.keys[l]
            values[l][i, :, : s.values[l].shape[1]] = s.values[l]
        for s in group:
            s.keys[l] = s.values[l] = None
    return keys, values


def _replay_group(drafter, embed, w, active: list[_Replay], bs: int, mask_id: int, dtype, device, full_drafts: bool,
                  bar) -> None:
    """Replay ``active`` in lockstep, one block each per round, as ``offline_tau`` describes.

    Args:
        active: the group's replay states, their context keys/values computed (``_context_kv``);
            each gets its anchors, drafts and accepted counts appended, and its anchor advanced.
        embed, w: the target's input embedding and lm_head weight [V, H].
        bs, mask_id: the drafter's block size and mask token.
        bar: the progress bar, advanced by the tokens each block covers.
    """
    n_layers = len(drafter.layers)
    keys, values = _padded_context(active, n_layers)
    while active:
        n = len(active)
        anchors = torch.tensor([s.a for s in active], device=device)
        S = int(anchors.max())
        # attend to the row's own context (pad slots masked) and to its whole block
        attend = torch.arange(S, device=device).unsqueeze(0) < anchors.unsqueeze(1)
        attend = torch.cat([attend, torch.ones(n, bs, dtype=torch.bool, device=device)], dim=1)
        block = torch.full((n, bs), mask_id, dtype=torch.long, device=device)
        block[:, 0] = torch.tensor([s.ids[s.a] for s in active], device=device)
        h = drafter(
            target_hidden=torch.zeros((n, 0, drafter.fc.in_features), dtype=dtype, device=device),
            noise_embedding=embed(block).to(dtype),
            position_ids=anchors.unsqueeze(1) + torch.arange(bs, device=device),
            attention_mask=attend[:, None, None, :],  # [n, 1, 1, S+bs]: the same row for every slot
            past_key_values=_ContextKV({l: k[:, :, :S] for l, k in keys.items()},
                                       {l: v[:, :, :S] for l, v in values.items()}),
            use_cache=True,
        )[:, 1:].to(w.dtype)  # slots 1..bs-1
        d = torch.full((n, bs - 1), -1, dtype=torch.long)
        r = [0] * n
        limit = [min(bs - 1, s.E - 1 - s.a) for s in active]  # drafted slots the trajectory can judge
        open_ = [True] * n
        k0, width = 0, 1
        while k0 < bs - 1 and any(open_):
            k1 = min(k0 + width, bs - 1)
            rows = [i for i in range(n) if open_[i]]
            d[rows, k0:k1] = (h[rows, k0:k1] @ w.T).argmax(-1).cpu()
            for i in rows:
                s = active[i]
                for k in range(k0, min(k1, limit[i])):
                    if int(d[i, k]) != s.ids[s.a + 1 + k]:
                        limit[i] = k  # first mismatch: r is final
                        break
                    r[i] += 1
                if not full_drafts and k1 >= limit[i]:
                    open_[i] = False
            k0, width = k1, width * 2
        for i, s in enumerate(active):
            s.anchors.append(s.a)
            s.drafts.append(d[i].clone())
            s.accepted.append(r[i])
            bar.update(min(r[i] + 1, s.E - 1 - s.a))
            s.a += r[i] + 1
        keep = [i for i, s in enumerate(active) if not s.done]
        if len(keep) < n:  # drop finished rows from the padded context once, not every round
            idx = torch.tensor(keep, dtype=torch.long, device=device)
            keys = {l: k.index_select(0, idx) for l, k in keys.items()}
            values = {l: v.index_select(0, idx) for l, v in values.items()}
            active = [active[i] for i in keep]


def offline_replay(drafter, target_model, traj: Trajectory, *, sample_id: str = "", full_drafts: bool = False) -> RolloutRecord:
    """``offline_tau`` for one trajectory (see there)."""
    return offline_tau(drafter, target_model, [traj], [sample_id], full_drafts=full_drafts)[0]
