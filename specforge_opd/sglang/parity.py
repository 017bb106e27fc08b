"""Whether a record SGLang served matches an in-process rollout of the same drafter and prompt (GPU checks).

``scripts/gpu_check_sglang_native.sh`` rolls out natively and in-process with the
same stop set (``models.target.stop_token_ids``: what SGLang stops on anyway) and
calls ``record_parity``: a shorter output, a different finish or different
blocks is a difference, not only the blocks both have.
"""

from __future__ import annotations

import torch


def record_parity(served, reference) -> list[str]:
    """The differences between two ``RolloutRecord``s of one prompt; empty when they agree.

    Compares the completion length, ``finished``, the number of blocks, and the anchors
    and accepted counts of every block (bf16 ties can flip a step on a GPU: the caller
    reports, it does not hide).
    """
    out = []
    if served.completion_tokens != reference.completion_tokens:
        out.append(f"completion tokens {served.completion_tokens} != reference {reference.completion_tokens}")
    if bool(served.finished) != bool(reference.finished):
        out.append(f"finished {bool(served.finished)} != reference {bool(reference.finished)}")
    if served.num_blocks != reference.num_blocks:
        out.append(f"blocks {served.num_blocks} != reference {reference.num_blocks}")
    n = min(served.num_blocks, reference.num_blocks)
    for name in ("anchors", "accepted"):
        a, b = getattr(served, name)[:n], getattr(reference, name)[:n]
        if not torch.equal(a, b):
            first = int((a != b).nonzero()[0, 0])
            out.append(f"{name} differ from block {first} ({int(a[first])} != {int(b[first])})")
    return out
