"""The acceptance-aware loss (paper Eq. 1, appendix 8) against brute-force per-slot computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from specforge_opd.train.losses import (
    kl_full,
    kl_full_and_grad,
    kl_token,
    kl_topk,
    linear_kl_loss,
    plan_slots,
    slot_coefficients,
    slot_kl,
)

V = 23


def _brute_kl(p, q):
    return sum(float(p[y]) * math.log(float(p[y]) / float(q[y])) for y in range(len(p)) if p[y] > 0)


def test_kl_identity_forward_is_cross_entropy_minus_entropy():
    torch.manual_seed(0)
    s, t = torch.randn(6, V), torch.randn(6, V)
    kl = kl_full(s, t, torch.zeros(6, dtype=torch.bool))
    p, logq = F.softmax(t, -1), F.log_softmax(s, -1)
    ce = -(p * logq).sum(-1)
    ent = -(p * p.log()).sum(-1)
    torch.testing.assert_close(kl, ce - ent, atol=1e-5, rtol=1e-5)


def test_kl_full_both_directions_match_brute_force():
    torch.manual_seed(1)
    s, t = torch.randn(4, V), torch.randn(4, V)
    rev = torch.tensor([False, True, False, True])
    kl = kl_full(s, t, rev)
    for i in range(4):
        p, q = F.softmax(t[i], -1), F.softmax(s[i], -1)
        want = _brute_kl(q, p) if rev[i] else _brute_kl(p, q)
        assert abs(float(kl[i]) - want) < 1e-5


def test_topk_equals_full_when_k_is_vocab():
    torch.manual_seed(2)
    s, t = torch.randn(5, V), torch.randn(5, V)
    logp = F.log_softmax(t, -1)
    vals, ids = logp.topk(V, -1)
    draft = torch.randint(0, V, (5,))
    dlp = logp.gather(1, draft.view(-1, 1)).squeeze(1)
    for rev in (False, True):
        r = torch.full((5,), rev)
        torch.testing.assert_close(kl_topk(s, ids, vals, draft, dlp, r), kl_full(s, t, r), atol=1e-5, rtol=1e-5)


def test_topk_is_brute_force_partition_kl_and_never_negative():
    torch.manual_seed(3)
    s, t = torch.randn(3, V) * 3, torch.randn(3, V) * 3
    logp = F.log_softmax(t, -1)
    k = 4
    vals, ids = logp.topk(k, -1)
    draft = torch.tensor([int(ids[0, 1]), 0, 5])  # row 0: draft inside the top-k
    draft[1:] = torch.tensor([int(logp[1].argsort()[0]), int(logp[2].argsort()[1])])  # rows 1,2: outside
    dlp = logp.gather(1, draft.view(-1, 1)).squeeze(1)
    for rev in (False, True):
        got = kl_topk(s, ids, vals, draft, dlp, torch.full((3,), rev))
        for i in range(3):
            cats = list(dict.fromkeys(ids[i].tolist() + [int(draft[i])]))
            p = F.softmax(t[i], -1)
            q = F.softmax(s[i], -1)
            pc = [float(p[c]) for c in cats] + [1 - sum(float(p[c]) for c in cats)]
            qc = [float(q[c]) for c in cats] + [1 - sum(float(q[c]) for c in cats)]
            want = _brute_kl(qc, pc) if rev else _brute_kl(pc, qc)
            assert abs(float(got[i]) - want) < 1e-4
            assert float(got[i]) >= 0
            # a partition KL lower-bounds the full KL (data processing inequality)
            assert float(got[i]) <= float(kl_full(s[i : i + 1], t[i : i + 1], torch.tensor([rev]))) + 1e-5


def test_topk_tail_never_negative_when_stored_logprobs_round_up():
    s = torch.randn(1, V)
    vals = torch.log(torch.full((1, V), 1.0 / V) * 1.001)  # sums to 1.001
    ids = torch.arange(V).view(1, -1)
    kl = kl_topk(s, ids[:, :V], vals, torch.tensor([0]), vals[:, 0], torch.tensor([False]))
    assert torch.isfinite(kl).all()


def test_token_estimators_match_their_formulas():
    torch.manual_seed(4)
    s = torch.randn(2, V)
    d = torch.tensor([3, 7])
    lp = torch.tensor([-0.5, -3.0])
    got = kl_token(s, d, lp, torch.tensor([False, True]))
    q0 = float(F.softmax(s[0], -1)[3])
    p0 = math.exp(-0.5)
    bern = p0 * math.log(p0 / q0) + (1 - p0) * math.log((1 - p0) / (1 - q0))
    delta = -3.0 - float(F.log_softmax(s[1], -1)[7])
    k3 = math.exp(delta) - delta - 1
    assert abs(float(got[0]) - bern) < 1e-5 and abs(float(got[1]) - k3) < 1e-5


def test_token_k3_is_clamped():
    s = torch.zeros(1, V)
    s[0, 0] = -100.0  # q(d) ~ exp(-100): huge log-ratio
    got = kl_token(s, torch.tensor([0]), torch.tensor([0.0]), torch.tensor([True]))
    assert float(got) == pytest.approx(10.0)


def test_plan_slots_mixed_weights_and_directions():
    plan = plan_slots(torch.tensor([2, 0]), 5, loss="mixed", rejected_decay=0.8)
    assert plan.block.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan.slot.tolist() == [1, 2, 3, 4, 1, 2, 3, 4]
    assert plan.rejected.tolist() == [False, False, True, True, True, True, True, True]
    assert plan.reverse.tolist() == plan.rejected.tolist()
    want = [1, 1, 0.8**2, 0.8**3, 1, 0.8, 0.8**2, 0.8**3]
    torch.testing.assert_close(plan.weight, torch.tensor(want, dtype=torch.float32))


def test_plan_slots_decay_from_first_rejected():
    plan = plan_slots(torch.tensor([2]), 5, decay_from="first_rejected", rejected_decay=0.5)
    assert plan.weight.tolist() == [1.0, 1.0, 1.0, 0.5]


def test_plan_slots_naive_keeps_verified_trajectory_only():
    plan = plan_slots(torch.tensor([1, 3]), 4, loss="naive_target_assisted")
    # block 0: slots 1 (accepted) and 2 (bonus); block 1: all accepted, no slot 4 in a bs=4 block
    assert plan.block.tolist() == [0, 0, 1, 1, 1]
    assert plan.slot.tolist() == [1, 2, 1, 2, 3]
    assert not plan.rejected.any() and not plan.reverse.any()
    assert plan.weight.tolist() == [1.0] * 5


@pytest.mark.parametrize("variant", ["all_forward", "all_reverse"])
def test_variants_flip_one_direction(variant):
    plan = plan_slots(torch.tensor([1, 2]), 4, loss=variant)
    assert plan.reverse.all() if variant == "all_reverse" else not plan.reverse.any()
    mixed = plan_slots(torch.tensor([1, 2]), 4)
    assert torch.equal(plan.weight, mixed.weight) and torch.equal(plan.rejected, mixed.rejected)


def _loss_of(plans, student, teacher, **kw):
    """Global loss from per-sequence plans via coefficients."""
    n_acc = sum(p.n_acc() for p in plans)
    w_rej = sum(p.w_rej() for p in plans)
    total = 0.0
    for plan, s, t in zip(plans, student, teacher):
        c = slot_coefficients(plan, n_acc, w_rej, **kw)
        kl = kl_full(s[plan.block, plan.slot - 1], t[plan.block, plan.slot - 1], plan.reverse)
        total = total + (c * kl).sum()
    return total


def _brute_eq1(accepted_list, student, teacher, bs, decay=0.8, la=1.0, lr=1.0, pooled=False):
    acc_terms, rej_terms = [], []
    for acc, s, t in zip(accepted_list, student, teacher):
        for m, r in enumerate(acc.tolist()):
            for k in range(1, bs):
                p, q = F.softmax(t[m, k - 1], -1), F.softmax(s[m, k - 1], -1)
                if k <= r:
                    acc_terms.append(_brute_kl(p, q))
                else:
                    rej_terms.append((decay ** (k - 1), _brute_kl(q, p)))
    if pooled:
        return (sum(acc_terms) + sum(w * x for w, x in rej_terms)) / (len(acc_terms) + sum(w for w, _ in rej_terms))
    L_acc = sum(acc_terms) / len(acc_terms) if acc_terms else 0.0
    L_rej = sum(w * x for w, x in rej_terms) / sum(w for w, _ in rej_terms) if rej_terms else 0.0
    return (la * L_acc + lr * L_rej) / (la + lr)


def _rand_batch(accepted_list, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    student = [torch.randn(len(a), bs - 1, V, generator=g) for a in accepted_list]
    teacher = [torch.randn(len(a), bs - 1, V, generator=g) for a in accepted_list]
    return student, teacher


@pytest.mark.parametrize("combine", ["eq1", "pooled"])
@pytest.mark.parametrize("lams", [(1.0, 1.0), (2.0, 0.5)])
def test_global_mixed_loss_matches_brute_force(combine, lams):
    bs = 5
    accepted = [torch.tensor([0, 4, 2]), torch.tensor([1]), torch.tensor([3, 3])]
    student, teacher = _rand_batch(accepted, bs)
    plans = [plan_slots(a, bs) for a in accepted]
    got = float(_loss_of(plans, student, teacher, lambda_acc=lams[0], lambda_rej=lams[1], combine=combine))
    want = _brute_eq1(accepted, student, teacher, bs, la=lams[0], lr=lams[1], pooled=combine == "pooled")
    assert abs(got - want) < 1e-5


def test_empty_rejected_term_keeps_the_accepted_share():
    bs = 4
    accepted = [torch.tensor([3, 3])]  # no rejected slot anywhere in the global batch
    student, teacher = _rand_batch(accepted, bs, seed=3)
    plans = [plan_slots(a, bs) for a in accepted]
    got = float(_loss_of(plans, student, teacher, lambda_acc=1.0, lambda_rej=3.0))
    L_acc = _brute_eq1(accepted, student, teacher, bs, la=1.0, lr=0.0)
    assert abs(got - L_acc / 4.0) < 1e-5  # la / (la + lr) * L_acc, not renormalized to L_acc


def test_all_forward_and_all_reverse_reduce_to_mixed_on_matching_blocks():
    bs = 4
    all_acc = [torch.tensor([3, 3])]
    all_rej = [torch.tensor([0, 0])]
    for acc, variant in ((all_acc, "all_forward"), (all_rej, "all_reverse")):
        student, teacher = _rand_batch(acc, bs, seed=5)
        mixed = _loss_of([plan_slots(a, bs) for a in acc], student, teacher)
        var = _loss_of([plan_slots(a, bs, loss=variant) for a in acc], student, teacher)
        assert float(mixed) == pytest.approx(float(var), abs=1e-6)
    # ...and they differ from mixed where directions do flip
    student, teacher = _rand_batch(all_rej, bs, seed=6)
    assert abs(float(_loss_of([plan_slots(all_rej[0], bs, loss="all_forward")], student, teacher))
               - float(_loss_of([plan_slots(all_rej[0], bs)], student, teacher))) > 1e-4


@pytest.mark.parametrize("inplace", [False, True])
def test_kl_full_and_grad_equal_autograd_through_kl_full(inplace):
    torch.manual_seed(3)
    s, t = torch.randn(6, V, requires_grad=True), torch.randn(6, V) * 2
    rev = torch.tensor([False, True, True, False, True, False])
    ref = kl_full(s, t, rev)
    g_ref = torch.autograd.grad(ref.sum(), s)[0]
    s_in, t_in = s.detach().clone(), t.clone()
    kl, g = kl_full_and_grad(s_in, t_in, rev, inplace=inplace)
    torch.testing.assert_close(kl, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-6)
    # bf16 autocast (the trainer's GPU setting) does not lower the KL's precision
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kl_ac, g_ac = kl_full_and_grad(s.detach(), t, rev)
    assert kl_ac.dtype == torch.float32 and g_ac.dtype == torch.float32
    torch.testing.assert_close(kl_ac, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_ac, g_ref, atol=1e-6, rtol=1e-6)
    # without inplace the inputs are untouched; with it they were used as buffers
    assert torch.equal(s_in, s.detach()) != inplace and torch.equal(t_in, t) != inplace


def test_kl_full_and_grad_is_as_precise_as_float32_autograd():
    # Regression: subtracting the log-sum-exp without the row max first made the
    # KL ~10x less precise than log_softmax + autograd near the teacher.
    def ref64(s, t, rev):
        logq, logp = F.log_softmax(s, -1), F.log_softmax(t, -1)
        return torch.where(rev, (logq.exp() * (logq - logp)).sum(-1), (logp.exp() * (logp - logq)).sum(-1))

    torch.manual_seed(4)
    t = torch.randn(8, 5000, dtype=torch.float64) * 3
    cases = [(t + 0.05 * torch.randn_like(t), False), (t + 0.05 * torch.randn_like(t), True),
             (torch.randn(8, 5000, dtype=torch.float64) * 150, True), (torch.randn(8, 5000, dtype=torch.float64) * 150, False)]
    for s, r in cases:
        rev = torch.full((8,), r)
        s64 = s.clone().requires_grad_(True)
        ref = ref64(s64, t, rev)
        g_ref = torch.autograd.grad(ref.sum(), s64)[0]
        s32 = s.float().requires_grad_(True)
        a = kl_full(s32, t.float(), rev)
        g_a = torch.autograd.grad(a.sum(), s32)[0]
        kl, g = kl_full_and_grad(s.float(), t.float(), rev)
        err = lambda x, y: float(((x.double() - y).abs() / y.abs().clamp_min(1e-30)).max())  # noqa: E731
        gerr = lambda x, y: float((x.double() - y).abs().max() / y.abs().max())  # noqa: E731
        assert err(kl, ref.detach()) <= 3 * err(a.detach(), ref.detach()) + 1e-7
        assert gerr(g, g_ref) <= 3 * gerr(g_a, g_ref) + 1e-7


def test_linear_kl_loss_refuses_double_backward_and_misaligned_slots():
    torch.manual_seed(2)
    plan = plan_slots(torch.tensor([1, 0]), 4)
    n = plan.num_slots
    coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())
    args = (coef, plan.reverse, plan.rejected, plan.weight)
    W, th = torch.randn(V, 8), torch.randn(n, 8)
    h = torch.randn(n, 8, requires_grad=True)
    loss, _, _ = linear_kl_loss(h, W, *args, teacher_hidden=th)
    (g,) = torch.autograd.grad(loss ** 2, h, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(g.sum(), h)
    with pytest.raises(ValueError, match="teacher_hidden has"):
        linear_kl_loss(h, W, *args, teacher_hidden=torch.randn(n + 1, 8))
    with pytest.raises(ValueError, match="coef has"):
        linear_kl_loss(h[:-1], W, *args, teacher_hidden=th[:-1])


def _plain_autograd_loss(h, W, coef, reverse, rejected, weight, teacher):
    """The reference: dense logits, the KL functions, ordinary autograd (no chunking)."""
    logits = h.to(W.dtype) @ W.t()
    th = teacher.get("teacher_hidden")
    kl = slot_kl(logits.float(), reverse, None if th is None else (th @ W.t()).float(),
                 teacher.get("topk_ids"), teacher.get("topk_logprobs"), teacher.get("draft_ids"), teacher.get("draft_logprob"))
    return (coef * kl).sum(), kl.detach()


@pytest.mark.parametrize("form,stream", [("full", "eq1"), ("topk", "eq1"), ("token", "eq1"), ("full", "verified"), ("topk", "verified")])
@pytest.mark.parametrize("chunk", [3, 4, 1000])
def test_linear_kl_loss_value_and_gradient_equal_plain_autograd(form, stream, chunk):
    torch.manual_seed(7)
    H = 8
    W = torch.randn(V, H)
    plan = plan_slots(torch.tensor([1, 0, 3, 2]), 4, accepted_stream=stream)
    n = plan.num_slots
    coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())
    args = (coef, plan.reverse, plan.rejected, plan.weight)
    teacher = {}
    if form == "full":
        teacher["teacher_hidden"] = torch.randn(n, H)
    else:
        teacher["draft_ids"] = torch.randint(0, V, (n,))
        teacher["draft_logprob"] = -torch.rand(n) * 3
        if form == "topk":
            teacher["topk_ids"] = torch.stack([torch.randperm(V)[:5] for _ in range(n)])
            teacher["topk_logprobs"] = torch.log_softmax(torch.randn(n, 5), -1) - 0.5
    h = torch.randn(n, H, requires_grad=True)
    ref, kl = _plain_autograd_loss(h, W, *args, teacher)
    g_ref = torch.autograd.grad(ref, h)[0]
    h2 = h.detach().clone().requires_grad_(True)
    # the gradient must flow through whatever produced the hidden states
    loss, acc, rej = linear_kl_loss(h2 * 1.0, W, *args, chunk_slots=chunk, **teacher)
    loss.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h2.grad, g_ref, atol=1e-6, rtol=1e-5)
    assert float(g_ref.abs().sum()) > 0
    torch.testing.assert_close(acc, kl[~plan.rejected].sum())
    torch.testing.assert_close(rej, (kl * plan.weight)[plan.rejected].sum())
    assert float(acc) > 0 and float(rej) > 0
    # without grad it returns the same value and keeps no graph
    with torch.no_grad():
        l2, _, _ = linear_kl_loss(h2, W, *args, chunk_slots=chunk, **teacher)
    assert not l2.requires_grad and float(l2) == pytest.approx(float(loss.detach()), abs=1e-6)


def test_linear_kl_loss_refuses_a_trainable_lm_head_and_a_zero_chunk():
    plan = plan_slots(torch.tensor([1]), 4)
    coef = slot_coefficients(plan, plan.n_acc(), plan.w_rej())
    args = (coef, plan.reverse, plan.rejected, plan.weight)
    h, th = torch.randn(3, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="frozen"):
        linear_kl_loss(h, torch.randn(V, 8, requires_grad=True), *args, teacher_hidden=th)
    with pytest.raises(ValueError, match="training.chunk_slots"):
        linear_kl_loss(h, torch.randn(V, 8), *args, chunk_slots=0, teacher_hidden=th)


def test_bad_config_values_name_the_field():
    with pytest.raises(ValueError, match="training.loss"):
        plan_slots(torch.tensor([1]), 4, loss="reverse_only")
    with pytest.raises(ValueError, match="accepted counts"):
        plan_slots(torch.tensor([4]), 4)
    with pytest.raises(ValueError, match="training.combine"):
        slot_coefficients(plan_slots(torch.tensor([1]), 4), 1.0, 1.0, combine="sum")


def test_plan_slots_verified_stream_adds_the_bonus_slot_once():
    plan = plan_slots(torch.tensor([1, 3, 0]), 4, accepted_stream="verified")
    # block 0: slots 1 (acc), 2 (bonus: acc fwd + rej rev), 3 (rej); block 1: all 3 accepted, no bonus slot;
    # block 2: slot 1 is the bonus (acc fwd + rej rev), 2 and 3 rejected
    assert plan.block.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert plan.slot.tolist() == [1, 2, 2, 3, 1, 2, 3, 1, 1, 2, 3]
    assert plan.rejected.tolist() == [False, False, True, True, False, False, False, False, True, True, True]
    assert plan.reverse.tolist() == plan.rejected.tolist()
    assert plan.weight.tolist()[:4] == pytest.approx([1.0, 1.0, 0.8, 0.8**2])
    assert plan.n_acc() == 6 and plan.w_rej() == pytest.approx(0.8 + 0.8**2 + 1 + 0.8 + 0.8**2)
    # naive target-assisted is the verified stream already: unchanged
    assert plan_slots(torch.tensor([1]), 4, loss="naive_target_assisted", accepted_stream="verified").slot.tolist() == [1, 2]
    with pytest.raises(ValueError, match="accepted_stream"):
        plan_slots(torch.tensor([1]), 4, accepted_stream="bonus")
    # a block the sequence's end cut short has no bonus token: no accepted-term entry past the end
    cut = plan_slots(torch.tensor([1, 0]), 4, accepted_stream="verified", bonus_kept=torch.tensor([True, False]))
    assert cut.block.tolist() == [0, 0, 0, 0] and cut.n_acc() == 2
    assert cut.slot.tolist() == [1, 2, 2, 3]


@pytest.mark.parametrize("loss", ["mixed", "all_forward", "all_reverse", "naive_target_assisted"])
@pytest.mark.parametrize("stream", ["eq1", "verified"])
def test_block_cut_short_trains_no_rejected_suffix(loss, stream):
    """The last block, cut by a stop token or the budget, trains its kept accepted slots only:
    its later slots were not rejected by verification (r_m is clipped to the tokens kept)."""
    acc = torch.tensor([1, 2])
    full = plan_slots(acc, 5, loss=loss, accepted_stream=stream)
    cut = plan_slots(acc, 5, loss=loss, accepted_stream=stream, bonus_kept=torch.tensor([True, False]))
    # block 0 is untouched
    b0 = full.block == 0
    assert cut.slot[cut.block == 0].tolist() == full.slot[b0].tolist()
    assert cut.rejected[cut.block == 0].tolist() == full.rejected[b0].tolist()
    # block 1: slots 1..r_1 = 1, 2, accepted term, weight 1; nothing past them
    b1 = cut.block == 1
    assert cut.slot[b1].tolist() == [1, 2]
    assert not cut.rejected[b1].any() and cut.weight[b1].tolist() == [1.0, 1.0]
    assert cut.w_rej() == pytest.approx(float(full.weight[b0 & full.rejected].sum()))


@pytest.mark.parametrize("combine", ["eq1", "pooled"])
def test_verified_stream_loss_matches_brute_force(combine):
    """The authors' stream: forward KL on slots 1..r_m+1 (teacher of slot r_m+1 = the verify output at r_m),
    decayed reverse KL on the rejected drafts r_m+1..bs-1."""
    bs = 5
    accepted = [torch.tensor([0, 4, 2]), torch.tensor([1]), torch.tensor([3, 3])]
    student, teacher = _rand_batch(accepted, bs, seed=7)
    plans = [plan_slots(a, bs, accepted_stream="verified") for a in accepted]
    got = float(_loss_of(plans, student, teacher, combine=combine))
    acc_terms, rej_terms = [], []
    for acc, s, t in zip(accepted, student, teacher):
        for m, r in enumerate(acc.tolist()):
            for k in range(1, bs):
                p, q = F.softmax(t[m, k - 1], -1), F.softmax(s[m, k - 1], -1)
                if k <= r + 1:
                    acc_terms.append(_brute_kl(p, q))
                if k > r:
                    rej_terms.append((0.8 ** (k - 1), _brute_kl(q, p)))
    if combine == "pooled":
        want = (sum(acc_terms) + sum(w * x for w, x in rej_terms)) / (len(acc_terms) + sum(w for w, _ in rej_terms))
    else:
        want = 0.5 * sum(acc_terms) / len(acc_terms) + 0.5 * sum(w * x for w, x in rej_terms) / sum(w for w, _ in rej_terms)
    assert abs(got - want) < 1e-5
