"""The export check: speculative decoding with an exported drafter must reproduce greedy target decoding.

It runs SpecForge's own ``DFlashDraftModel.spec_generate`` on purpose, as a reference
outside this project's decoding loops: a wrong export (weights, mask token, layer ids)
shows as a divergence from plain greedy decoding at a position that is not a tie.
"""

from __future__ import annotations

from specforge_opd.models.target import cut_at_stop
from specforge_opd.stepkeys import SFTError


class _CallCounter:
    """Counts forward calls of a module (the target's verify steps inside ``spec_generate``)."""

    def __init__(self, module):
        self.n = 0
        self._h = module.register_forward_hook(lambda *_: setattr(self, "n", self.n + 1))

    def close(self):
        self._h.remove()


def _greedy(model, prompt: list[int], max_new: int, stop: list[int]) -> list[int]:
    import torch

    dev = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt], device=dev), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=stop, pad_token_id=stop[0])
    return cut_at_stop(out[0, len(prompt):].tolist(), set(stop), max_new)[0]


def _top2_gap(model, prefix: list[int]) -> float:
    import torch

    dev = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prefix], device=dev), logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def verify_export(drafter, target_model, prompts: list[list[int]], stop_token_ids: list[int], max_new: int) -> dict:
    """Speculative decoding with ``drafter`` must reproduce greedy target decoding.

    Uses SpecForge's ``DFlashDraftModel.spec_generate`` at temperature 0. A
    divergence is tolerated only where the target's top-2 logit gap on the
    greedy prefix is below 1e-4 (DESIGN.md section 3, "Numerical ties").
    Returns ``{"prompts", "tokens", "verify_steps", "tau"}``; tau = completion
    tokens (prefill token included) / verify steps, pooled over the prompts.

    Raises:
        SFTError: an output differs from greedy decoding at a non-tie position.
    """
    import torch

    drafter = drafter.to(next(target_model.parameters()).device).eval()
    tokens = steps = 0
    for p in prompts:
        ref = _greedy(target_model, p, max_new, stop_token_ids)
        counter = _CallCounter(target_model)
        try:
            with torch.inference_mode():
                out = drafter.spec_generate(target_model, torch.tensor([p], device=next(target_model.parameters()).device),
                                            max_new, list(stop_token_ids), 0.0)
        finally:
            counter.close()
        got = out[0, len(p):].tolist()
        n = min(len(got), len(ref))
        first = next((j for j in range(n) if got[j] != ref[j]), None)
        if first is None and len(got) != len(ref):
            first = n
        if first is not None and first < min(len(got), len(ref)):
            gap = _top2_gap(target_model, p + ref[:first])
            if gap >= 1e-4:
                raise SFTError(f"sft export check: speculative output differs from greedy decoding at response "
                               f"token {first} (top-2 gap {gap:.3g}, not a tie): the export or its "
                               "mask token / layer ids are wrong")
        elif first is not None:
            raise SFTError(f"sft export check: speculative output has {len(got)} tokens, greedy {len(ref)}")
        tokens += len(got)
        steps += max(1, counter.n - 1)  # the first call is the prefill
    return {"prompts": len(prompts), "tokens": tokens, "verify_steps": steps,
            "tau": tokens / steps if steps else float("nan")}

