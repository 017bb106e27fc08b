"""The teacher forms a rollout can record (``rollout.teacher``), defined once.

A ground-layer module with no internal imports: ``config`` re-exports it for the
config field, and the rollout and training modules import it from here. They do
not import ``config`` for it because ``config`` resolves ``published:`` names
through ``models.published``, which reaches back up into rollout, eval and stages.
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

#: The teacher signal a rollout records per drafted slot (``rollout.records.Teacher``):
#: ``full`` the target's final hidden state, ``topk`` its top-k log-probs and the drafted
#: token's, ``token`` the drafted token's log-prob alone.
TeacherForm = Literal["full", "topk", "token"]
TEACHER_FORMS: tuple[TeacherForm, ...] = get_args(TeacherForm)


def bonus_teacher_missing(accepted_stream: str, form: Optional[str]) -> bool:
    """True when ``training.accepted_stream`` needs a teacher distribution that ``form`` does not hold.

    The ``verified`` stream trains the bonus slot against the target's distribution
    conditioned on the accepted prefix; the ``token`` form stores only the drafted
    tokens' log-probs. ``form`` None (no teacher stored: the trainer recomputes it)
    is never missing one.
    """
    return accepted_stream == "verified" and form == "token"
