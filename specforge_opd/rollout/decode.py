"""The target's forward on a preallocated KV cache: the decode path of rollout, SFT responses and evaluation.

Every embedded stage is bound by the target's decode speed, and a decode step
of a small target is a chain of ~200 small GEMMs over weights that do not fit
in cache. Two things keep it near that chain's own cost:

- ``KVCache`` preallocates one key and one value buffer per layer,
  ``[B, kv_heads, capacity, head_dim]``, and writes each step's keys in place.
  Attention reads the view ``[:, :, :length]``, so no step copies the cache
  (transformers' ``DynamicCache`` concatenates, copying it every step).
  ``crop``, ``select_rows`` (dropping finished rows) and ``gather_slots``
  (squeezing holes) are the engine's bookkeeping verbs.
- ``TargetRunner`` runs the decoder layers itself with the HF modules' weights:
  fused QKV and gate/up projections, and on a CPU the weights prepacked for
  oneDNN (measured on the 2-core machine: a 32-row decode chain takes about 55%
  of the time of plain ``F.linear`` in fp32, a 1- or 8-row chain about half;
  ``benchmarks/bench_decode.py``). It returns the final-norm hidden state and the
  context features of the requested layers only (DESIGN.md section 3: the
  feature of layer k is the output of decoder layer k, HF ``hidden_states[k + 1]``;
  for the last layer HF's entry is the final-norm output, and so is ours).

Architectures: dense Llama-style decoders (Llama, Qwen2 with its QKV bias,
Qwen3 with its per-head q/k norms), full attention in every layer. Anything else
(MoE MLPs, sliding-window layers, other attention variants) runs through the
HF forward on a ``DynamicCache`` wrapped in the same interface (``HFCache``),
so the engine has one code path. The weights of a target are read once, when its
runner is first built (``TargetRunner.of``): targets are frozen.
"""

from __future__ import annotations

import logging
import weakref
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# caches


class KVCache:
    """Preallocated per-layer key/value buffers shared by a batch, with a slot ``length``.

    Args:
        num_layers, batch, kv_heads, head_dim: the buffers' shape
            ``[batch, kv_heads, capacity, head_dim]`` per layer.
        capacity: initial slots; a write past it doubles the buffers (one copy).
        dtype, device: those of the target's weights.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, dtype, device):
        shape = (batch, kv_heads, max(int(capacity), 1), head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0
        #: Number of times the buffers grew (a capacity sized right keeps this 0).
        self.grown = 0

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    def get_seq_length(self) -> int:
        """Slots in use (valid and hole slots alike)."""
        return self.length

    def reserve(self, q: int) -> None:
        """Make room for ``q`` more slots (doubling the capacity when full)."""
        need = self.length + int(q)
        if need <= self.capacity:
            return
        cap = max(need, 2 * self.capacity)
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = old.new_empty((old.shape[0], old.shape[1], cap, old.shape[3]))
                new[:, :, : self.length] = old[:, :, : self.length]
                bufs[i] = new
        self.grown += 1

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store ``k``/``v`` ``[B, kv_heads, q, D]`` at slots ``length..length+q-1`` of ``layer``
        (``reserve(q)`` first); returns the views over slots ``0..length+q-1``."""
        s, e = self.length, self.length + k.shape[2]
        self.keys[layer][:, :, s:e] = k
        self.values[layer][:, :, s:e] = v
        return self.keys[layer][:, :, :e], self.values[layer][:, :, :e]

    def crop(self, n: int) -> None:
        """Keep slots ``0..n-1`` (later writes overwrite the rest)."""
        self.length = min(int(n), self.length)

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` (int64 [B']) of the batch, in that order."""
        L = self.length
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = old.new_empty((int(idx.numel()), old.shape[1], old.shape[2], old.shape[3]))
                new[:, :, :L] = old[:, :, :L].index_select(0, idx.to(old.device))
                bufs[i] = new

    def gather_slots(self, slot_idx: torch.Tensor) -> None:
        """Rewrite every layer so that slot j of row b becomes old slot ``slot_idx[b, j]`` (int64 [B, W], W <= length)."""
        W = int(slot_idx.shape[1])
        for bufs in (self.keys, self.values):
            for buf in bufs:
                idx = slot_idx.to(buf.device).view(buf.shape[0], 1, W, 1).expand(buf.shape[0], buf.shape[1], W, buf.shape[3])
                buf[:, :, :W] = torch.gather(buf[:, :, : self.length], 2, idx)
        self.length = W

    def write_rows(self, rows: torch.Tensor, src: "KVCache", width: int) -> None:
        """Copy slots ``0..width-1`` of every row of ``src`` into rows ``rows`` (int64 [k]) of this cache, same slots.

        Continuous batching: a prompt prefilled on its own (``src``, k rows) takes the place of
        finished rows. ``width`` <= this cache's ``length``; the rows' other slots keep stale
        contents, which their valid maps mark as holes.
        """
        for dst, sb in ((self.keys, src.keys), (self.values, src.values)):
            for layer, buf in enumerate(dst):
                buf[rows.to(buf.device), :, :width] = sb[layer][:, :, :width]

    def pad_front(self, n: int) -> None:
        """Insert ``n`` hole slots before slot 0 in every row, zeroed.

        Zeroed, not left as they were: attention reads every slot and masks holes with a
        -inf score and a zero weight, and ``0 * NaN`` (fresh ``torch.empty`` memory) would
        poison every row of the batch.
        """
        if n <= 0:
            return
        L = self.length
        self.reserve(n)
        for bufs in (self.keys, self.values):
            for buf in bufs:
                buf[:, :, n:n + L] = buf[:, :, :L].clone()
                buf[:, :, :n].zero_()
        self.length = L + n


class HFCache:
    """transformers' ``DynamicCache`` behind ``KVCache``'s verbs, for targets ``TargetRunner`` does not run itself."""

    def __init__(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()

    def _layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    def get_seq_length(self) -> int:
        return int(self.cache.get_seq_length())

    def crop(self, n: int) -> None:
        self.cache.crop(int(n))

    def select_rows(self, idx: torch.Tensor) -> None:
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, idx.to(layer.keys.device))
            layer.values = layer.values.index_select(0, idx.to(layer.values.device))

    def gather_slots(self, slot_idx: torch.Tensor) -> None:
        for layer in self._layers():
            k = layer.keys
            idx = slot_idx.to(k.device).view(k.shape[0], 1, -1, 1).expand(k.shape[0], k.shape[1], -1, k.shape[3])
            layer.keys = torch.gather(k, 2, idx)
            layer.values = torch.gather(layer.values, 2, idx)

    def write_rows(self, rows: torch.Tensor, src: "HFCache", width: int) -> None:
        """``KVCache.write_rows`` on the DynamicCache's tensors (both caches initialized, same layers)."""
        for dst, sl in zip(self._layers(), src._layers()):
            r = rows.to(dst.keys.device)
            dst.keys[r, :, :width] = sl.keys[:, :, :width]
            dst.values[r, :, :width] = sl.values[:, :, :width]

    def pad_front(self, n: int) -> None:
        """``KVCache.pad_front``: ``n`` hole slots before slot 0 (zeros)."""
        if n <= 0:
            return
        for layer in self._layers():
            z = layer.keys.new_zeros(layer.keys.shape[0], layer.keys.shape[1], n, layer.keys.shape[3])
            layer.keys = torch.cat([z, layer.keys], dim=2)
            layer.values = torch.cat([z.new_zeros(z.shape[:3] + layer.values.shape[3:]), layer.values], dim=2)


# ---------------------------------------------------------------------------
# linear layers


class _Linear:
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN on a CPU, plain ``F.linear`` elsewhere."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], pack: bool):
        self.bias = None if bias is None else bias.detach()
        self.out_features = int(weight.shape[0])
        self.packed = False
        w = weight.detach()
        if pack:
            try:
                w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 32)
                self.packed = True
            except (RuntimeError, AttributeError) as e:  # oneDNN lacks this dtype here: plain matmuls
                log.debug("no oneDNN prepacking (%s); plain F.linear", e)
        self.weight = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _fused(mods: Sequence[torch.nn.Module], pack: bool) -> _Linear:
    """One linear for several with the same input (their outputs concatenated in order)."""
    if len(mods) == 1:
        return _Linear(mods[0].weight, mods[0].bias, pack)
    w = torch.cat([m.weight.detach() for m in mods], dim=0)
    biases = [m.bias for m in mods]
    b = None if all(x is None for x in biases) else torch.cat(
        [x.detach() if x is not None else m.weight.new_zeros(m.weight.shape[0]) for x, m in zip(biases, mods)]
    )
    return _Linear(w, b, pack)


# ---------------------------------------------------------------------------
# the runner


#: Architectures whose decoder layer is exactly what ``TargetRunner.forward`` computes (pre-norm
#: attention with rotate-half RoPE on every layer, SiLU-gated MLP, plain residuals, Qwen3's
#: per-head q/k norms). Others that merely have the same module names differ in ways the
#: names do not show (Granite's multipliers, OLMo's QKV clipping, SmolLM3's no-RoPE layers,
#: Helium's interleaved RoPE, StableLM's partial rotary): they take the HF path.
NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3")
#: RoPE variants whose frequencies do not depend on the call (HF's ``dynamic`` recomputes them
#: from each call's longest position, so chunked prefill would change it): others take the HF path.
NATIVE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _unsupported_reason(model) -> Optional[str]:
    """Why ``TargetRunner`` cannot run ``model`` itself (None when it can)."""
    cfg = getattr(model.config, "text_config", model.config)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in NATIVE_MODEL_TYPES:
        return f"model_type {mtype!r} is not one of {NATIVE_MODEL_TYPES}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in NATIVE_ROPE_TYPES:
        return f"rope_type {rope_type!r} is not one of {NATIVE_ROPE_TYPES}"
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None or not hasattr(body, "embed_tokens") or not hasattr(body, "norm") or not hasattr(body, "rotary_emb"):
        return "not a decoder-only HF model with model.layers/embed_tokens/norm/rotary_emb"
    for layer in layers:
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or m is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            return "attention without q/k/v/o projections"
        if not all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "MLP without gate/up/down projections (MoE?)"
        if not (hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")):
            return "decoder layer without pre-norms"
    return None


def _sliding_window(model) -> bool:
    """True when some layer attends through a window: ``layer_types``, Qwen2/3's ``use_sliding_window``,
    or a ``sliding_window`` that other configs (Mistral's) apply whenever it is set."""
    cfg = getattr(model.config, "text_config", model.config)
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types):
        return True
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return False
    if hasattr(cfg, "use_sliding_window"):
        return bool(cfg.use_sliding_window)
    return True


_RUNNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _weights_version(model) -> int:
    """Sum of the parameters' in-place modification counters: changes when any weight is edited in place."""
    return sum(int(p._version) for p in model.parameters())


class TargetRunner:
    """Runs a frozen HF target's forward on a ``KVCache`` (or, for other architectures, HF's on an ``HFCache``).

    Args:
        model: HF causal LM in eval mode (``.model`` body, ``.lm_head``), on its device and dtype.
        pack: prepack weights for oneDNN; default: on when the weights are on a CPU.

    Use ``TargetRunner.of(model)`` to build a model's runner once (packing reads every weight); it
    is rebuilt when the model's weights are edited in place (their version counters change).

    Raises:
        ValueError: the target has sliding-window layers. Every forward gets an explicit
            4-D mask of each row's verified prefix, which HF then uses for all layers as
            given, so a window would be silently ignored on either path.
    """

    def __init__(self, model, pack: Optional[bool] = None):
        if _sliding_window(model):
            raise ValueError(
                "target with sliding-window attention layers: the embedded decode path attends over the whole "
                "prefix; use a full-attention target or an SGLang rollout backend (rollout.backend)"
            )
        # the body, not the model: the runner cache is keyed weakly by the model, so a value that
        # referenced its key would keep every target ever run (and its packed copy) alive
        self.body = model.model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.weights_version = _weights_version(model)
        self.reason = _unsupported_reason(model)
        self.native = self.reason is None
        if pack is None:
            pack = self.device.type == "cpu"
        # fusing copies the projection weights: worth it on a CPU, where they are packed
        # (a copy anyway); on a GPU the originals are used as they are
        fuse = pack
        self.lm_head = _Linear(model.lm_head.weight, getattr(model.lm_head, "bias", None), pack)
        self.packed = bool(pack) and self.lm_head.packed
        if not self.native:
            log.info("target runner: HF forward on a DynamicCache (%s)", self.reason)
            return
        cfg = getattr(model.config, "text_config", model.config)
        self.num_layers = len(model.model.layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(model.model.layers[0].self_attn.head_dim)
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            if fuse:
                qkv, gate_up = [_fused([a.q_proj, a.k_proj, a.v_proj], pack)], [_fused([m.gate_proj, m.up_proj], pack)]
            else:
                qkv = [_Linear(x.weight, x.bias, False) for x in (a.q_proj, a.k_proj, a.v_proj)]
                gate_up = [_Linear(x.weight, x.bias, False) for x in (m.gate_proj, m.up_proj)]
            self.layers.append(
                dict(
                    in_norm=layer.input_layernorm,
                    post_norm=layer.post_attention_layernorm,
                    q_norm=getattr(a, "q_norm", None),
                    k_norm=getattr(a, "k_norm", None),
                    qkv=qkv,
                    o=_Linear(a.o_proj.weight, a.o_proj.bias, pack),
                    gate_up=gate_up,
                    down=_Linear(m.down_proj.weight, getattr(m.down_proj, "bias", None), pack),
                    act=m.act_fn,
                    scaling=float(a.scaling),
                )
            )
        self.final_norm = model.model.norm

    @classmethod
    def of(cls, model) -> "TargetRunner":
        """The runner of ``model``, built on first use and kept while the model lives."""
        r = _RUNNERS.get(model)
        p = next(model.parameters())
        # rebuilt when the weights moved, changed dtype, or were edited in place (packing copied them)
        if r is None or r.device != p.device or r.dtype != p.dtype or r.weights_version != _weights_version(model):
            r = cls(model)
            _RUNNERS[model] = r
        return r

    def new_cache(self, batch: int, capacity: int):
        """An empty cache for ``batch`` rows and about ``capacity`` slots (``KVCache``, or ``HFCache``)."""
        if not self.native:
            return HFCache()
        return KVCache(self.num_layers, batch, self.kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head over final-norm hidden states ``[..., H]``; returns ``[..., V]`` in the target's dtype.

        One 2-D GEMM over all rows: given a strided view such as the drafter's slots 1..bs-1
        (``out[:, 1:]``), CUDA's matmul runs a batched GEMM that reads the [V, H] weight once
        per batch row (measured on an H200 at batch 8: 2.4 ms a draft step, a quarter of the
        step). The CPU's matmul already copies and runs one GEMM: the values are the same.
        """
        h = hidden.to(self.dtype)
        return self.lm_head(h.reshape(-1, h.shape[-1])).view(*h.shape[:-1], -1)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache, layer_ids=None):
        """One forward of ``q`` new slots after the cache's ``S`` slots; the new keys/values are appended.

        Args:
            input_ids, position_ids: int64 [B, q] (explicit positions: rows may be left-padded).
            attention_mask: bool [B, 1, q, S + q], True = attend (``step_mask``).
            cache: from ``new_cache`` (its length grows by q).
            layer_ids: decoder layers whose outputs to return as context features, or None.
        Returns:
            (final-norm hidden [B, q, H], features [B, q, len(layer_ids) * H] in id order, or None).
        """
        if not self.native:
            return self._hf_forward(input_ids, position_ids, attention_mask, cache, layer_ids)
        body = self.body
        B, q = input_ids.shape
        want = {int(k): None for k in (layer_ids or [])}
        x = body.embed_tokens(input_ids)
        cos, sin = body.rotary_emb(x, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        cache.reserve(q)
        nq, nkv, D = self.num_heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
        bias = None
        for i, L in enumerate(self.layers):
            h = L["in_norm"](x)
            if len(L["qkv"]) == 1:
                qs, ks, vs = L["qkv"][0](h).split([nq, nkv, nkv], dim=-1)
            else:
                qs, ks, vs = (f(h) for f in L["qkv"])
            qs, ks, vs = qs.view(B, q, -1, D), ks.view(B, q, -1, D), vs.view(B, q, -1, D)
            if L["q_norm"] is not None:
                qs, ks = L["q_norm"](qs), L["k_norm"](ks)
            qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
            qs, ks = _rope(qs, cos, sin), _rope(ks, cos, sin)
            keys, values = cache.write(i, ks, vs)
            if bias is None and q <= SMALL_QUERY:
                # the additive mask, built once per forward, not once per layer
                bias = torch.zeros(attention_mask.shape, dtype=torch.float32, device=x.device).masked_fill_(~attention_mask, float("-inf"))
            att = _attend(qs, keys, values, attention_mask, L["scaling"], bias)
            x = x + L["o"](att.transpose(1, 2).reshape(B, q, nq))
            h = L["post_norm"](x)
            if len(L["gate_up"]) == 1:
                g, u = L["gate_up"][0](h).chunk(2, dim=-1)
            else:
                g, u = (f(h) for f in L["gate_up"])
            x = x + L["down"](L["act"](g) * u)
            if i in want:
                want[i] = x
        cache.length += q
        hidden = self.final_norm(x)
        if self.num_layers - 1 in want:
            # HF's hidden_states[num_layers] is the final-norm output, not the last layer's
            want[self.num_layers - 1] = hidden
        if not want:
            return hidden, None
        if any(v is None for v in want.values()):
            bad = [k for k, v in want.items() if v is None]
            raise ValueError(f"target_layer_ids {bad} are not decoder layers of this target (0..{self.num_layers - 1})")
        return hidden, torch.cat([want[int(k)] for k in layer_ids], dim=-1)

    def _hf_forward(self, input_ids, position_ids, attention_mask, cache, layer_ids):
        out = self.body(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache.cache,
            use_cache=True,
            output_hidden_states=bool(layer_ids),
        )
        if not layer_ids:
            return out.last_hidden_state, None
        # lazy: the adapter loads SpecForge, which the SGLang verify client and the stand-in (both import
        # this module through rollout.step) never use
        from specforge_opd.models.adapter import extract_context_feature

        return out.last_hidden_state, extract_context_feature(out.hidden_states, layer_ids)


# ---------------------------------------------------------------------------
# masks, padding and prefill over the slot layout (the in-process rollout's and plain decoding's)


def step_mask(kv_valid: torch.Tensor, q_valid: torch.Tensor) -> torch.Tensor:
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


def prefill(runner, cache, ids: torch.Tensor, valid: torch.Tensor, pos: torch.Tensor, layer_ids=None, chunk: int = 256,
            all_hidden: bool = False):
    """Run left-padded prompts through the target in chunks of ``chunk`` columns, appending to ``cache``.

    No forward sees more than ``chunk`` queries, so no [P, P] mask or score matrix
    is built for a long prompt. Pad slots are holes (``valid`` False).

    Args:
        runner: ``TargetRunner``; cache: its ``new_cache`` (empty).
        ids, pos: int64 [B, P]; valid: bool [B, P].
        layer_ids: decoder layers whose features to return, or None.
        all_hidden: return the final-norm hidden state of every column, not only the last.
    Returns:
        (final-norm hidden of the last column [B, 1, H] (every column [B, P, H] with
        ``all_hidden``), features [B, P, n*H] or None).
    Raises:
        ValueError: ``chunk`` < 1 (``target.prefill_chunk``).
    """
    if chunk < 1:
        raise ValueError(f"target.prefill_chunk={chunk}: must be at least 1")
    P = ids.shape[1]
    feats, hiddens = [], []
    hidden = None
    for s in range(0, P, chunk):
        e = min(P, s + chunk)
        mask = step_mask(valid[:, :s], valid[:, s:e])
        hidden, f = runner.forward(ids[:, s:e], pos[:, s:e], mask, cache, layer_ids)
        if f is not None:
            feats.append(f)
        if all_hidden:
            hiddens.append(hidden)
    return (torch.cat(hiddens, dim=1) if all_hidden else hidden[:, -1:]), (torch.cat(feats, dim=1) if feats else None)


@torch.no_grad()
def capture(runner, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int], *, chunk: int = 256,
            hidden: bool = False) -> list:
    """Teacher-forced features of whole sequences at the requested layers: one batched prefill, no cache kept.

    What the SFT features step and the evaluation cache store: the output of decoder layer
    k for each position (DESIGN.md section 3: HF ``hidden_states[k + 1]``; the last layer's
    is the final-norm output), concatenated in ``layer_ids`` order. Only those layers are
    kept, where the HF forward with ``output_hidden_states`` keeps every layer.

    Args:
        runner: ``TargetRunner``.
        sequences: token id lists (non-empty), left-padded together: batch ones of similar length.
        layer_ids: decoder layers (empty: features None).
        chunk: columns per forward (``target.prefill_chunk``).
        hidden: also return each position's final-norm hidden state (for logits).
    Returns:
        per sequence ``(features [T, len(layer_ids) * H] or None, hidden [T, H] or None)`` in the target's
        dtype and device, T = the sequence's length.
    """
    ids, valid, pos = left_pad(sequences, runner.device)
    cache = runner.new_cache(ids.shape[0], ids.shape[1])
    h, f = prefill(runner, cache, ids, valid, pos, list(layer_ids), chunk, all_hidden=hidden)
    return [(None if f is None else f[b, valid[b]], h[b, valid[b]] if hidden else None) for b in range(ids.shape[0])]


#: Up to this many query slots (decode and verify steps) attention is two batched matmuls;
#: beyond it (prefill chunks) SDPA's tiled kernel, which never holds every head's [q, S] scores.
SMALL_QUERY = 32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q`` [B, Hq, q, D] over ``k``/``v`` [B, Hkv, S, D] (GQA: query head h reads KV head
    h // (Hq / Hkv), as HF's ``repeat_kv``), bool ``mask`` [B, 1, q, S] (True = attend); returns [B, Hq, q, D].

    Few query slots: scores of all query heads that share a KV head come from one
    matmul over the cache's keys, read in place (the cache views reshape to
    [B * Hkv, S, D] without a copy); softmax in fp32. Measured on the 2-core CPU at
    batch 32 over 251 slots: 0.46 ms a layer against SDPA's 0.54 in fp32, and 0.59
    against 4.0 in bf16, where CPU SDPA has no fast kernel for one query. Longer
    queries (prefill chunks) take SDPA, in fp32 when the cache is bf16/fp16 on a CPU.
    ``bias``: the mask as float32 0/-inf [B, 1, q, S], when the caller built it already
    (once per forward rather than once per layer).
    """
    B, Hq, nq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if nq > SMALL_QUERY:
        if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=Hkv != Hq)
            return out.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=Hkv != Hq)
    g = Hq // Hkv
    q3 = q.reshape(B * Hkv, g * nq, D)
    scores = torch.bmm(q3, k.reshape(B * Hkv, S, D).transpose(1, 2)).float().view(B, Hkv, g, nq, S)
    if bias is None:
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill_(~mask, float("-inf"))
    scores = scores.mul_(scale).add_(bias.view(B, 1, 1, nq, S))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(B * Hkv, g * nq, S)
    return torch.bmm(probs, v.reshape(B * Hkv, S, D)).view(B, Hq, nq, D)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's ``apply_rotary_pos_emb`` convention (rotate_half over the last dim)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
