"""A scripted annotator: stands in for people where a preference can be written down (tests, the example loop).

    from rlt2t.services.annotation.scripted import rank_by_score
    rank_by_score(store, store.annotator_by_name("bot"), lambda source, candidate: -len(candidate.split()))

It goes through the same submissions as the web app (one transaction per item, idempotent by id), so what it
leaves in the database exports exactly as people's work does.
"""

from __future__ import annotations

from collections.abc import Callable

from rlt2t.services.annotation.store import Annotator, Store, Submission


def rank_by_score(store: Store, annotator: Annotator, score: Callable[[str, str], float], *,
                  limit: int | None = None, max_per_item: int = 0) -> int:
    """Rank every item of ``annotator``'s queue by ``score(source, candidate)``, highest first (ties keep the
    stored candidate order); at most ``limit`` items. Returns how many items were ranked."""
    ranked = 0
    while limit is None or ranked < limit:
        item = store.next_item(annotator, max_per_item)
        if item is None:
            break
        order = sorted(item.candidates, key=lambda c: -score(item.source, c.text))
        store.submit(annotator, Submission(submission_id=f"scripted-{annotator.id}-{item.id}", item_id=item.id,
                                           action="rank", order=tuple(c.id for c in order)))
        ranked += 1
    return ranked
