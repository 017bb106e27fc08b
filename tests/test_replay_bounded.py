"""Bounded replay: the teacher recompute without full-vocabulary logits or an [L, L] mask, and
replay in groups of blocks with the gradient of one forward, for every loss option."""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from specforge_opd.models.adapter import create_dflash_sdpa_mask
from specforge_opd.models.drafter import drafter_layer_ids
from specforge_opd.train.losses import plan_slots, slot_coefficients
from specforge_opd.train.replay import (
    ReplayError,
    block_groups,
    dflash_flex_block_mask,
    recompute_from_target,
    recompute_largest_tensor_bytes,
    replay_hidden,
)
from specforge_opd.train.trainer import sequence_group_losses, sequence_loss

from conftest import make_tiny_drafter, make_tiny_target
from opd_helpers import make_record
from replay_reference import recompute_from_target_dense

VOCAB, MASK = 2048, 2047


class LargestTensor(TorchDispatchMode):
    """Records the largest storage any op allocates (parameters, buffers and inputs excluded) and
    every trailing 2-D shape of a float or bool tensor (activations, masks), on the CPU."""

    def __init__(self, *modules, inputs=()):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for m in modules for t in list(m.parameters()) + list(m.buffers())}
        self.skip |= {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        self.bytes, self.what, self.shapes = 0, None, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                if t.dim() >= 2 and (t.is_floating_point() or t.dtype == torch.bool):  # activations and masks, not ids
                    self.shapes.add(tuple(t.shape[-2:]))
                st = t.untyped_storage()
                if st.data_ptr() not in self.skip and st.nbytes() > self.bytes:
                    self.bytes, self.what = st.nbytes(), (str(func), tuple(t.shape))
        return out


@pytest.fixture(scope="module")
def wide():
    """A target whose vocabulary dominates its width (as Qwen3's 151936 over 4096), 3 layers."""
    target = make_tiny_target(vocab=VOCAB, hidden=32, layers=3).requires_grad_(False)
    drafter = make_tiny_drafter(target, block_size=4, layers=2, mask_token_id=MASK)
    return target, drafter


def _record(target, layers, form, seed=1, response_len=120, prompt_len=40):
    return make_record(target, layers, seed=seed, prompt_len=prompt_len, response_len=response_len, block_size=4, form=form,
                       topk=8, vocab_hi=2000, greedy=False)


@pytest.mark.parametrize("form", ["full", "topk", "token"])
def test_recompute_equals_the_dense_forward(wide, form):
    """Same features and teacher as the one-forward recompute, whatever the group size; the last
    layer's feature is the final-norm output (HF hidden_states[-1]); repeated ids repeat columns."""
    target, _ = wide
    layers = [2, 0, 2]
    rec = _record(target, layers, form)
    ref = recompute_from_target_dense(target, rec, layers, form=form, topk=8)
    for G, chunk in ((1, 5), (7, 16), (10_000, 1024)):
        got = recompute_from_target(target, rec, layers, form=form, topk=8, max_blocks_per_forward=G, chunk_rows=chunk)
        torch.testing.assert_close(got.features, ref.features, atol=2e-5, rtol=1e-5)
        if form == "full":
            torch.testing.assert_close(got.teacher_hidden, ref.teacher_hidden, atol=2e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(got.teacher_draft_logprob, ref.teacher_draft_logprob, atol=2e-5, rtol=1e-5)
        if form == "topk":
            assert torch.equal(got.teacher_topk_ids, ref.teacher_topk_ids)
            torch.testing.assert_close(got.teacher_topk_logprobs, ref.teacher_topk_logprobs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["full", "topk", "token"])
def test_recompute_largest_tensor_is_bounded(wide, form):
    """Counted on the CPU: the dense recompute's largest tensor is the fp32 [L, V] logits and it
    builds an [L, L] mask; the bounded one stays under ``recompute_largest_tensor_bytes``,
    which does not grow with L * V, and never allocates an [L, L] tensor."""
    target, drafter = wide
    layers = drafter_layer_ids(drafter)
    rec = _record(target, layers, form)
    S, M, n = rec.input_ids.numel() - 1, rec.num_blocks, rec.block_size - 1
    L = S + n * M
    old = LargestTensor(target)
    with old:
        recompute_from_target_dense(target, rec, layers, form=form, topk=8)
    assert old.bytes >= L * VOCAB * 4 and (L, L) in old.shapes
    new = LargestTensor(target)
    with new:
        recompute_from_target(target, rec, layers, form=form, topk=8, max_blocks_per_forward=8, chunk_rows=16)
    bound = recompute_largest_tensor_bytes(target.config, S, M, rec.block_size, form=form, topk=8, n_feature_layers=len(layers),
                                           max_blocks_per_forward=8, chunk_rows=16, dtype_bytes=4)
    assert new.bytes <= bound, new.what
    assert (L, L) not in new.shapes
    assert bound * 10 < L * VOCAB * 4
    if form == "full":  # no vocabulary-wide tensor at all: the trainer applies the lm_head in chunks
        assert all(VOCAB not in s for s in new.shapes)


def test_recompute_refuses_bad_sizes(wide):
    target, drafter = wide
    rec = _record(target, drafter_layer_ids(drafter), "full", response_len=20)
    with pytest.raises(ReplayError, match="max_blocks_per_forward"):
        recompute_from_target(target, rec, drafter_layer_ids(drafter), max_blocks_per_forward=0)
    with pytest.raises(ReplayError, match="rollout.teacher"):
        recompute_from_target(target, rec, drafter_layer_ids(drafter), form="dense")


def test_block_groups():
    assert block_groups(5, None) == [(0, 5)] and block_groups(5, 5) == [(0, 5)] and block_groups(5, 9) == [(0, 5)]
    assert block_groups(5, 2) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ReplayError, match="max_blocks_per_forward"):
        block_groups(5, 0)


def test_flex_block_mask_equals_the_sdpa_mask():
    """The BlockMask (built eagerly here; compiled on CUDA) allows exactly SpecForge's dense mask."""
    from torch.nn.attention.flex_attention import create_mask

    anchors, S, bs = torch.tensor([3, 4, 9, 15, 16]), 17, 4
    bm = dflash_flex_block_mask(anchors, S, bs, "cpu", compile=False)
    dense = create_dflash_sdpa_mask(anchor_positions=anchors.view(1, -1), block_keep_mask=torch.ones(1, 5, dtype=torch.bool),
                                    S=S, block_size=bs, device="cpu")
    assert bm.shape[-2:] == (5 * bs, S + 5 * bs)
    assert torch.equal(create_mask(bm.mask_mod, 1, 1, 5 * bs, S + 5 * bs, device="cpu"), dense)
    assert torch.equal(bm.to_dense().bool().any(), torch.tensor(True))


def test_replayed_group_equals_its_blocks_in_the_whole_forward(wide):
    target, drafter = wide
    rec = _record(target, drafter_layer_ids(drafter), "full", response_len=40)
    emb = target.model.embed_tokens
    with torch.no_grad():
        whole = replay_hidden(drafter, emb, rec, MASK)
        for b0, b1 in block_groups(rec.num_blocks, 3):
            torch.testing.assert_close(replay_hidden(drafter, emb, rec, MASK, blocks=(b0, b1)), whole[b0:b1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ReplayError, match="blocks"):
        replay_hidden(drafter, emb, rec, MASK, blocks=(2, 2))


# Every loss option; the token teacher has no bonus-slot distribution, so no verified stream with it.
OPTIONS = [
    (loss, stream, combine, decay_from, form)
    for loss, stream, combine, decay_from, form in itertools.product(
        ("mixed", "all_forward", "all_reverse", "naive_target_assisted"), ("eq1", "verified"), ("eq1", "pooled"),
        ("slot1", "first_rejected"), ("full", "topk", "token"))
    if not (stream == "verified" and form == "token")
]


@pytest.fixture(scope="module")
def records_by_form(wide):
    target, drafter = wide
    layers = drafter_layer_ids(drafter)
    return {form: [_record(target, layers, form, seed=s, response_len=30, prompt_len=6) for s in (1, 2)] for form in ("full", "topk", "token")}


def _grads(drafter, target, recs, plans, coefs, G):
    drafter.zero_grad(set_to_none=True)
    total = 0.0
    for rec, plan, coef in zip(recs, plans, coefs):
        for loss, _, _ in sequence_group_losses(drafter, target.model.embed_tokens, target.lm_head.weight, rec, plan, coef,
                                                mask_token_id=MASK, chunk_slots=7, max_blocks_per_forward=G):
            loss.backward()
            total += float(loss.detach())
    return total, {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss,stream,combine,decay_from,form", OPTIONS)
def test_grouped_replay_has_the_gradient_of_one_forward(wide, records_by_form, loss, stream, combine, decay_from, form):
    target, drafter = wide
    drafter = drafter.train()
    recs = records_by_form[form]
    plans = [plan_slots(r.accepted, r.block_size, loss=loss, decay_from=decay_from, accepted_stream=stream,
                        bonus_kept=r.anchors + r.accepted + 1 < r.input_ids.numel()) for r in recs]
    n_acc, w_rej = sum(p.n_acc() for p in plans), sum(p.w_rej() for p in plans)
    coefs = [slot_coefficients(p, n_acc, w_rej, combine=combine) for p in plans]
    assert all(r.num_blocks > 2 for r in recs)
    l1, g1 = _grads(drafter, target, recs, plans, coefs, None)
    l2, g2 = _grads(drafter, target, recs, plans, coefs, 2)
    assert l1 == pytest.approx(l2, rel=1e-5) and l1 > 0
    assert g1.keys() == g2.keys() and g1
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], atol=1e-6, rtol=1e-4, msg=k)


def test_sequence_loss_sums_its_groups_and_pads_with_zero_weight(wide, records_by_form):
    target, drafter = wide
    rec = records_by_form["full"][0]
    plan = plan_slots(rec.accepted, rec.block_size)
    coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())
    kw = dict(mask_token_id=MASK, chunk_slots=7)
    one = sequence_loss(drafter, target.model.embed_tokens, target.lm_head.weight, rec, plan, coef, **kw)
    two = sequence_loss(drafter, target.model.embed_tokens, target.lm_head.weight, rec, plan, coef, max_blocks_per_forward=2, **kw)
    for a, b in zip(one, two):
        assert float(a) == pytest.approx(float(b), rel=1e-5)
    n = len(block_groups(rec.num_blocks, 2))
    parts = list(sequence_group_losses(drafter, target.model.embed_tokens, target.lm_head.weight, rec, plan, coef,
                                       max_blocks_per_forward=2, num_groups=n + 2, **kw))
    assert len(parts) == n + 2 and all(float(p[0]) == 0.0 for p in parts[n:])
    with pytest.raises(ValueError, match="num_groups"):
        next(sequence_group_losses(drafter, target.model.embed_tokens, target.lm_head.weight, rec, plan, coef,
                                   max_blocks_per_forward=2, num_groups=1, **kw))


@pytest.mark.parametrize("source", ["shard", "target"])
def test_distill_in_groups_equals_one_forward(tmp_path, source):
    """The trainer with training.max_blocks_per_forward=1 (every block its own forward and backward,
    the recompute's verify too) takes the steps of the default one-forward replay."""
    from specforge_opd.config import load_config
    from specforge_opd.train.trainer import distill

    from fault_hooks import FaultHooks
    from opd_helpers import make_records

    target = make_tiny_target()
    drafter = make_tiny_drafter(target, block_size=4, layers=2)
    records = make_records(target, drafter_layer_ids(drafter), 3, block_size=4, response_len=12)
    if source == "target":
        for r in records:
            r.features, r.teacher = None, None
    grads = {}
    for G in (512, 1):
        seen = []
        cfg = load_config(None, [f"training.max_blocks_per_forward={G}", f"training.feature_source={source}", "training.batch_size=2",
                                 "output.tensorboard=false", f"output.dir={tmp_path / str(G)}"])
        distill(cfg, drafter_init=drafter, out_dir=tmp_path / str(G), target=target, records=records, progress=False,
                hooks=FaultHooks(gradients=lambda step, d: seen.append({k: p.grad.clone() for k, p in d.named_parameters()})))
        grads[G] = seen
    assert len(grads[1]) == len(grads[512]) == 2
    for a, b in zip(grads[512], grads[1]):
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-4, msg=k)


def test_max_blocks_per_forward_must_be_positive():
    from specforge_opd.config import load_config

    with pytest.raises(Exception, match="max_blocks_per_forward"):
        load_config(None, ["training.max_blocks_per_forward=0"])


def test_step_group_counts_are_the_same_on_every_rank():
    """Ranks replay as many groups as the rank with the most at each position (FSDP2's collectives pair up);
    a rank padding a short last batch counts the record it replays with zero weight."""
    from types import SimpleNamespace

    from specforge_opd.train.trainer import BatchOrder, step_group_counts

    records = [SimpleNamespace(num_blocks=n) for n in (1, 5, 9, 2, 4)]
    order = BatchOrder(num_records=5, batch_size=1, accumulation_steps=2, world_size=2, num_epochs=1, seed=0, shuffle=False)
    # step 0: micro 0 -> records 0 (rank 0), 1 (rank 1); micro 1 -> 2, 3. Groups of 2 blocks: 1, 3, 5, 1.
    assert step_group_counts(order, 0, records, 2) == [[3], [5]]
    # step 1: record 4 on rank 0 only; rank 1 pads with record 4 as well
    assert step_group_counts(order, 1, records, 2) == [[2], [2]]
    assert step_group_counts(order, 0, records, 512) == [[1], [1]]


def test_grouped_replay_never_allocates_all_blocks_at_once(wide):
    """Counted on the CPU, forward and backward: one forward over all M blocks holds [M*bs, ...]
    activations and an [M*bs, S + M*bs] mask; in groups of 2 no tensor has M*bs rows."""
    target, drafter = wide
    drafter = drafter.train()
    rec = _record(target, drafter_layer_ids(drafter), "full", response_len=120)
    plan = plan_slots(rec.accepted, rec.block_size)
    coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())
    Q = rec.num_blocks * rec.block_size
    peaks = {}
    for G in (None, 2):
        m = LargestTensor(target, drafter)
        with m:
            for loss, _, _ in sequence_group_losses(drafter, target.model.embed_tokens, target.lm_head.weight, rec, plan, coef,
                                                    mask_token_id=MASK, chunk_slots=7, max_blocks_per_forward=G):
                loss.backward()
        drafter.zero_grad(set_to_none=True)
        peaks[G] = m
    assert any(Q in s for s in peaks[None].shapes)
    assert not any(Q in s for s in peaks[2].shapes)
    assert peaks[2].bytes * 3 < peaks[None].bytes


def test_flex_mask_function_traces_without_graph_breaks():
    """What ``create_block_mask(_compile=True)`` needs on a GPU: one graph, no break. The context length
    is a tensor, so a new sequence changes an input of that graph, not a constant baked into it."""
    bm = dflash_flex_block_mask(torch.tensor([3, 4, 9]), 10, 4, "cpu", compile=False)
    zero = torch.zeros((), dtype=torch.long)
    ex = torch._dynamo.explain(bm.mask_mod)(zero, zero, torch.arange(12).view(-1, 1), torch.arange(22).view(1, -1))
    assert ex.graph_count == 1 and ex.graph_break_count == 0
