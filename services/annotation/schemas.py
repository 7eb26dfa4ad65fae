"""The annotation app's JSON API: request and response models (``rlt2t.services.annotation.app``).

Requests forbid unknown fields and non-finite numbers and are strict, as the policy and reward servers' are: no
string is read as a number or a boolean (``"6"`` is not the candidate id 6, ``1`` is not ``true``). A typo, a
NaN rating or a wrong type is a 422 naming the field; so is an id beyond the database's id columns, and text
no database can store (a NUL character).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from rlt2t.services.annotation.store import unstorable

MAX_CANDIDATES = 256
"""Hard cap on a list in a submission (annotate.max_candidates_per_item is at most this)."""
NOTE_MAX_CHARS = 2000

MAX_ID = 2**31 - 1
"""Ids are ``Integer`` columns (``tables``): 32-bit signed on PostgreSQL, so a larger id in a request is a 422
naming the field on either backend, not a driver overflow (a 500 on PostgreSQL)."""
MAX_OFFSET = 10**9
"""Bound on a list's offset (far beyond any annotation count; an OFFSET is 64-bit on SQLite and PostgreSQL)."""
PAGE_SIZE = 50
"""Rows per page of /history."""

SubmissionId = Annotated[str, StringConstraints(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
DbId = Annotated[int, Field(ge=-MAX_ID, le=MAX_ID)]
"""An item, candidate or annotation id as a request gives it (within ±MAX_ID; one that names nothing is a 404
or a 422 of the store's checks)."""


def _storable(text: str) -> str:
    problem = unstorable(text)
    if problem is not None:
        raise ValueError(problem)
    return text


StoredText = Annotated[str, AfterValidator(_storable)]
"""Text a request stores or looks up: NUL is a 422 naming the field (PostgreSQL's text cannot hold it)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, use_attribute_docstrings=True)


class _Response(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class Progress(_Response):
    done: int
    """Items this annotator ranked, rated or skipped."""
    left: int
    """Items still in their queue."""
    skipped: int
    """Of the done items, those skipped."""
    flagged: int
    """Their annotations carrying a flag."""


class CandidateRating(_Request):
    candidate_id: DbId
    """A candidate of the item."""
    rating: float
    """Within [annotate.rating_min, annotate.rating_max]."""


class AnnotationView(_Response):
    annotation_id: int
    item_id: int
    annotator: str
    status: Literal["ranked", "rated", "partial", "skipped"]
    """`partial`: some candidates rated so far."""
    order: list[int]
    """Candidate ids best first (`ranked`), else empty."""
    ratings: list[CandidateRating]
    """Ratings given (`rated`, `partial`), else empty."""
    flagged: bool
    note: str
    updated_at: float
    """Unix seconds of the last submission."""
    revision: int
    """Submissions applied to this annotation so far; send it back as a submission's `base_revision`."""


class CandidateView(_Response):
    id: int
    text: str


class ItemView(_Response):
    item_id: int
    source: str
    candidates: list[CandidateView]
    """In this annotator's display order (annotate.shuffle_candidates)."""
    annotation: AnnotationView | None
    """The caller's own annotation of the item (never another annotator's)."""


class NextResponse(_Response):
    item: ItemView | None
    """The first item of the caller's queue; null when none is left."""
    progress: Progress


class SubmissionRequest(_Request):
    """One write to one item; resending the same `submission_id` changes nothing and returns the stored result."""

    submission_id: SubmissionId
    """Client-generated unique id (e.g. a UUID): makes a retried or doubled submission harmless."""
    item_id: DbId
    action: Literal["rank", "rate", "skip"]
    """`rank`: `order` is every candidate id best first; `rate`: `ratings` of some or all candidates (merged
    with earlier ones); `skip`: the item leaves the queue unjudged."""
    order: list[DbId] = Field(default_factory=list, max_length=MAX_CANDIDATES)
    ratings: list[CandidateRating] = Field(default_factory=list, max_length=MAX_CANDIDATES)
    flagged: bool | None = None
    """Mark the item as problematic (bad source, broken candidates); flagged items stay out of exports. Left out
    (or null): the annotation keeps its flag (none on a new one)."""
    note: Annotated[str, StringConstraints(max_length=NOTE_MAX_CHARS), AfterValidator(_storable)] | None = None
    """Why it was flagged, or any remark. Left out (or null): the annotation keeps its note."""
    base_revision: Annotated[int, Field(ge=0, le=MAX_ID)] | None = None
    """The `revision` of the caller's annotation this submission was made against (0: it had none yet). When
    the annotation has moved on since (saved in another tab or by another script of the same annotator), the
    answer is a 409 with the current revision and nothing changes; resend with that revision to overwrite.
    Left out (or null): no check, the submission replaces whatever is stored (the page always sends it)."""


class StaleRevisionResponse(_Response):
    """409 to a submission whose `base_revision` is not the annotation's current revision."""

    detail: str
    revision: int
    """The annotation's current revision: send it as `base_revision` to overwrite."""
    annotation: AnnotationView | None
    """What is stored now (null: nothing, the base revision named one that does not exist)."""


class SubmissionResponse(_Response):
    annotation: AnnotationView
    duplicate: bool
    """True when this submission id had been applied before (nothing changed now)."""
    progress: Progress


class AnnotationList(_Response):
    annotations: list[AnnotationView]
    """Newest first."""
    total: int


class Me(_Response):
    name: str
    role: Literal["annotator", "admin"]
    mode: Literal["rank", "rate"]
    rating_min: float
    rating_max: float
    rating_step: float


class AnnotatorStatsView(_Response):
    name: str
    role: str
    ranked: int
    rated: int
    partial: int
    skipped: int
    flagged: int


class PairAgreementView(_Response):
    annotator_a: str
    annotator_b: str
    items: int
    """Shared items with a defined Kendall τ-b."""
    mean_tau: float | None
    undefined: int
    """Shared items where one judgement was constant (τ undefined)."""


class FlaggedView(_Response):
    annotation_id: int
    item_id: int
    annotator: str
    source: str
    note: str


class AdminSummary(_Response):
    items: int
    annotators: list[AnnotatorStatsView]
    agreement: list[PairAgreementView]
    mean_tau: float | None
    """Mean Kendall τ-b over every (annotator pair, shared item)."""
    comparisons: int
    flagged: list[FlaggedView]
