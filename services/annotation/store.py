"""The annotation database: migrations, and every read and write of the app, the terminal loop and the exports.

SQLite in the run directory by default, PostgreSQL by URL (``annotate.database_url``), through SQLAlchemy
Core. The schema is versioned with alembic (``migrations/``); :meth:`Store.open` upgrades a database to the
newest revision this code knows, under a lock (SQLite's write lock, PostgreSQL's advisory lock) so two
processes opening one database at once do not both migrate, and refuses a database a newer rlt2t migrated.

Data model: an *item* is a source and its K *candidates*. An annotator holds at most one *annotation* per
item (status ``ranked``, ``rated``, ``partial``: some candidates rated, or ``skipped``; plus a flag and a
note) with one *label* per judged candidate (its rank, 0 = best, or its rating). Every write arrives as a
*submission* with a client-generated id, applied in one transaction together with the record of that id:
a repeated id (a double click, a retry after a lost answer, a page reloaded with a pending submission) is
answered with the stored result and changes nothing; an id reused for different content is refused. A
submission sets the flag and the note only where it gives them: the terminal's ratings, which say nothing of
either, keep a flag set in the browser (and so keep the item out of the exports).

Each applied submission moves the annotation's *revision* on by one (a new annotation is revision 1). A
submission that names the revision it was made against (``base_revision``, 0: no annotation yet) is refused
with :class:`StaleRevision` when the annotation has moved on since: the same annotator's other tab or machine
saved the item in between, and replacing that unseen would lose it. Overwriting is then an explicit second
submission against the current revision. A submission naming none (the terminal loop, scripts) applies to
whatever is there.

- ``rank``: a permutation of the item's candidate ids, best first; replaces the annotation's labels.
- ``rate``: ratings of some or all candidates; merged into earlier ratings (the terminal stores each one as
  it is typed), replacing a ranking or a skip. ``rated`` once every candidate has a rating.
- ``skip``: the item leaves the annotator's queue without labels.

On SQLite every write transaction starts with ``BEGIN IMMEDIATE``: with the driver's default (a deferred
transaction that upgrades its lock at the first write) two concurrent writers can deadlock, and SQLite then
fails one at once instead of waiting out ``busy_timeout``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    and_,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    make_url,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError, OperationalError

from rlt2t.common.config import Config

# The table `annotations` goes by another name: here `annotations` is the __future__ import's.
from rlt2t.services.annotation.tables import annotations as annotations_table
from rlt2t.services.annotation.tables import (
    annotators,
    candidates,
    items,
    labels,
    sessions,
    submissions,
)

log = logging.getLogger("rlt2t.services.annotation")
logging.getLogger("alembic").setLevel(logging.WARNING)  # one INFO line per plugin and step on every open

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
SCHEMA_HEAD = "0002"
"""The newest revision in migrations/versions (a test checks it is alembic's head): a database already there
opens without importing alembic at all (half a second of every CLI call)."""
DONE = ("ranked", "rated", "skipped")
"""Annotation statuses that take an item out of its annotator's queue."""
JUDGED = ("ranked", "rated")
"""Statuses whose labels order every candidate (what agreement compares)."""
ROLES = ("annotator", "admin")

# --- errors -----------------------------------------------------------------------------------------------

class StoreError(ValueError):
    """The database cannot be used (unknown schema revision, bad URL, a duplicate annotator name)."""


class NotFound(LookupError):
    """The item or annotation does not exist, or the caller may not see it (both answer 404)."""


class InvalidSubmission(ValueError):
    """A submission that does not fit its item; ``field`` names the offending request field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class SubmissionConflict(ValueError):
    """A submission id already used for different content (or by another annotator)."""


class StaleRevision(SubmissionConflict):
    """A submission made against an older revision of the annotation than the stored one."""

    def __init__(self, item_id: int, base: int, current: AnnotationRecord | None) -> None:
        self.item_id, self.base, self.current = item_id, base, current
        self.revision = current.revision if current is not None else 0
        super().__init__(f"item {item_id} was saved elsewhere since (revision {self.revision}; this submission was "
                         f"made against revision {base}): load it again, or send base_revision {self.revision} to "
                         "overwrite it")


# --- records ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Annotator:
    id: int
    name: str
    role: str

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True, slots=True)
class NewItem:
    """An item to add: a source and its candidates (distinct, in their original order)."""

    source: str
    candidates: tuple[str, ...]
    origin: str
    ext_id: str | None = None
    policy_version: int | None = None

    @property
    def content_sha256(self) -> str:
        """Identity of an item: the same source and candidates are the same item, whichever file they came from."""
        return hashlib.sha256(json.dumps([self.source, list(self.candidates)], ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Candidate:
    id: int
    position: int
    text: str


@dataclass(frozen=True, slots=True)
class Item:
    id: int
    source: str
    candidates: tuple[Candidate, ...]
    ext_id: str | None
    origin: str


@dataclass(frozen=True, slots=True)
class AnnotationRecord:
    id: int
    item_id: int
    annotator: str
    status: str
    flagged: bool
    note: str
    order: tuple[int, ...]
    """Candidate ids best first (``ranked``), else empty."""
    ratings: dict[int, float]
    """Candidate id → rating (``rated`` / ``partial``), else empty."""
    updated_at: float
    revision: int
    """Submissions applied to this annotation (1 after the first)."""


@dataclass(frozen=True, slots=True)
class Submission:
    """One write of one annotator to one item (see the module docstring for the actions)."""

    submission_id: str
    item_id: int
    action: Literal["rank", "rate", "skip"]
    order: tuple[int, ...] = ()
    ratings: dict[int, float] = field(default_factory=dict)
    flagged: bool | None = None
    """Set or clear the annotation's flag; None keeps it (False on a new annotation)."""
    note: str | None = None
    """Replace the annotation's note; None keeps it (empty on a new annotation)."""
    base_revision: int | None = None
    """The annotation's revision this was made against (0: none yet); StaleRevision when it has moved on. None:
    no check. Not part of the digest: a condition of applying the content, not the content."""

    def digest(self) -> str:
        body = [self.item_id, self.action, list(self.order), sorted(self.ratings.items()), self.flagged, self.note]
        return hashlib.sha256(json.dumps(body).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class SubmitOutcome:
    annotation: AnnotationRecord
    duplicate: bool
    """True when the submission id was seen before: nothing was written."""


@dataclass(frozen=True, slots=True)
class Progress:
    done: int
    """Items this annotator ranked, rated or skipped."""
    left: int
    """Items still in this annotator's queue (partly rated ones included)."""
    skipped: int
    flagged: int


@dataclass(frozen=True, slots=True)
class AnnotatorStats:
    name: str
    role: str
    ranked: int
    rated: int
    partial: int
    skipped: int
    flagged: int


@dataclass(frozen=True, slots=True)
class FlaggedItem:
    annotation_id: int
    item_id: int
    annotator: str
    source: str
    note: str


def unstorable(text: str) -> str | None:
    """Why some database of the store cannot hold ``text`` (None: all can): a lone surrogate has no UTF-8, and
    PostgreSQL's text refuses NUL (SQLite would keep it: the check makes both backends answer alike)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"not encodable as UTF-8 ({e.reason} {text[e.start]!r} at character {e.start})"
    nul = text.find("\x00")
    if nul >= 0:
        return f"contains a NUL character (\\u0000) at character {nul}, which PostgreSQL cannot store"
    return None


def token_digest(token: str) -> str:
    """Tokens are 256-bit random strings: a plain SHA-256 is enough to store them (no slow hash needed)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def display_order(item: Item, annotator_id: int, shuffle: bool) -> tuple[Candidate, ...]:
    """The order an annotator sees an item's candidates in: their own fixed random one, against position bias."""
    if not shuffle:
        return item.candidates
    shown = list(item.candidates)
    random.Random(f"{annotator_id}:{item.id}").shuffle(shown)
    return tuple(shown)


# --- the store --------------------------------------------------------------------------------------------

def _sqlite_setup(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # the driver's own transaction handling off: BEGIN is ours
        cursor = dbapi_conn.cursor()
        for pragma in ("foreign_keys=ON", "journal_mode=WAL", "busy_timeout=15000"):
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.info.get("rlt2t_write") else "BEGIN")


def database_url(cfg: Config) -> str:
    """``annotate.database_url`` with ``{run}`` expanded."""
    return cfg.annotate.database_url.replace("{run}", cfg.run.dir)


def open_store(cfg: Config) -> Store:
    """The configured annotation database, migrated to the newest schema."""
    a = cfg.annotate
    return Store.open(database_url(cfg), rating_range=(a.rating_min, a.rating_max))


def create_store_engine(url: str) -> Engine:
    """An engine for ``url``; a SQLite file's directory is created."""
    try:
        parsed = make_url(url)
    except Exception as e:  # sqlalchemy raises ArgumentError with its own wording
        raise StoreError(f"annotate.database_url: not a database URL: {e}") from None
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed)
        _sqlite_setup(engine)
        return engine
    if parsed.get_backend_name() != "postgresql":
        raise StoreError(f"annotate.database_url: {parsed.get_backend_name()} is not supported (sqlite or postgresql)")
    if parsed.drivername == "postgresql":  # SQLAlchemy's default driver would be psycopg2; ours is psycopg 3
        parsed = parsed.set(drivername="postgresql+psycopg")
    try:
        return create_engine(parsed, pool_size=10, max_overflow=30, pool_pre_ping=True)
    except ImportError as e:
        raise StoreError(f"annotate.database_url: the driver of {parsed.drivername} is missing ({e}); "
                         f"pip install 'psycopg[binary]'") from None


class Store:
    """Every database operation of the annotation app, the terminal loop and the exports."""

    def __init__(self, engine: Engine, *, rating_range: tuple[float, float] = (-2.0, 2.0)) -> None:
        self.engine = engine
        self.rating_range = rating_range

    @classmethod
    def open(cls, url: str, *, rating_range: tuple[float, float] = (-2.0, 2.0), migrate: bool = True) -> Store:
        """Connect to ``url`` and upgrade its schema to the newest revision (see :func:`upgrade`); StoreError
        naming annotate.database_url (password hidden) when the database cannot be reached."""
        store = cls(create_store_engine(url), rating_range=rating_range)
        try:
            stamped = _stamped_revision(store) if migrate else SCHEMA_HEAD
        except OperationalError as e:  # no server, refused, wrong password, a SQLite file that cannot be opened
            store.close()
            reason = " ".join(str(e.orig or e).split())
            password = store.engine.url.password
            if password:
                reason = reason.replace(str(password), "***")
            raise StoreError(f"annotate.database_url: cannot open {store.url}: {reason}") from None
        if stamped != SCHEMA_HEAD:
            try:
                upgrade(store)
            except BaseException:
                store.close()
                raise
        return store

    def close(self) -> None:
        self.engine.dispose()

    @property
    def url(self) -> str:
        """The database URL with any password hidden (for logs)."""
        return self.engine.url.render_as_string(hide_password=True)

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction (on SQLite it holds the write lock from its first statement)."""
        with self.engine.connect() as conn:
            conn.info["rlt2t_write"] = True
            try:
                with conn.begin():
                    yield conn
            finally:
                conn.info.pop("rlt2t_write", None)

    # --- annotators and sessions ---------------------------------------------------------------------------

    def add_annotator(self, name: str, role: str = "annotator") -> str:
        """Create an annotator; returns their bearer token (shown once: only its hash is stored)."""
        if role not in ROLES:
            raise StoreError(f"role must be one of {ROLES}, got {role!r}")
        name = name.strip()
        if not name or len(name) > 64 or any(c.isspace() for c in name):
            raise StoreError(f"annotator name {name!r}: 1-64 characters, no spaces")
        token = secrets.token_urlsafe(32)
        try:
            with self.write() as conn:
                conn.execute(insert(annotators).values(name=name, role=role, token_sha256=token_digest(token),
                                                       created_at=time.time()))
        except IntegrityError:
            raise StoreError(f"annotator {name!r} exists already (a new token for them: `rlt2t annotate add-user "
                             f"{name} --reset`)") from None
        return token

    def reset_token(self, name: str) -> str:
        """A new token for ``name`` (the old one and their browser sessions stop working)."""
        token = secrets.token_urlsafe(32)
        with self.write() as conn:
            row = conn.execute(select(annotators.c.id).where(annotators.c.name == name)).first()
            if row is None:
                raise StoreError(f"no annotator named {name!r}")
            conn.execute(update(annotators).where(annotators.c.id == row.id).values(token_sha256=token_digest(token)))
            conn.execute(delete(sessions).where(sessions.c.annotator_id == row.id))
        return token

    def annotator_by_token(self, token: str) -> Annotator | None:
        with self.read() as conn:
            row = conn.execute(select(annotators.c.id, annotators.c.name, annotators.c.role)
                               .where(annotators.c.token_sha256 == token_digest(token))).first()
        return Annotator(row.id, row.name, row.role) if row else None

    def annotator_names(self) -> list[str]:
        """Every annotator's name, sorted."""
        with self.read() as conn:
            return sorted(row.name for row in conn.execute(select(annotators.c.name)))

    def annotator_by_name(self, name: str) -> Annotator | None:
        with self.read() as conn:
            row = conn.execute(select(annotators.c.id, annotators.c.name, annotators.c.role)
                               .where(annotators.c.name == name)).first()
        return Annotator(row.id, row.name, row.role) if row else None

    def create_session(self, annotator: Annotator, ttl_s: float) -> tuple[str, str]:
        """A browser session: (session token for the cookie, CSRF token for the page)."""
        token, csrf, now = secrets.token_urlsafe(32), secrets.token_urlsafe(32), time.time()
        with self.write() as conn:
            conn.execute(delete(sessions).where(sessions.c.expires_at < now))  # expired ones go here, lazily
            conn.execute(insert(sessions).values(id_sha256=token_digest(token), annotator_id=annotator.id,
                                                 csrf_token=csrf, created_at=now, expires_at=now + ttl_s))
        return token, csrf

    def session(self, token: str) -> tuple[Annotator, str] | None:
        """The annotator and CSRF token of a live session, or None."""
        with self.read() as conn:
            row = conn.execute(
                select(annotators.c.id, annotators.c.name, annotators.c.role, sessions.c.csrf_token)
                .join(annotators, annotators.c.id == sessions.c.annotator_id)
                .where(sessions.c.id_sha256 == token_digest(token), sessions.c.expires_at > time.time())).first()
        return (Annotator(row.id, row.name, row.role), row.csrf_token) if row else None

    def delete_session(self, token: str) -> None:
        with self.write() as conn:
            conn.execute(delete(sessions).where(sessions.c.id_sha256 == token_digest(token)))

    # --- items ---------------------------------------------------------------------------------------------

    def add_items(self, new: Sequence[NewItem]) -> tuple[int, int]:
        """Add items in one transaction; returns (added, already present). Adding a file twice adds nothing."""
        added = 0
        now = time.time()
        with self.write() as conn:
            known: set[str] = set()
            digests = [n.content_sha256 for n in new]
            for start in range(0, len(digests), 500):
                known.update(conn.execute(select(items.c.content_sha256).where(
                    items.c.content_sha256.in_(digests[start:start + 500]))).scalars())
            for item, digest in zip(new, digests, strict=True):
                if digest in known:
                    continue
                known.add(digest)
                item_id = conn.execute(insert(items).values(
                    content_sha256=digest, ext_id=item.ext_id, source=item.source, origin=item.origin[:500],
                    policy_version=item.policy_version, created_at=now).returning(items.c.id)).scalar_one()
                conn.execute(insert(candidates), [{"item_id": item_id, "position": i, "text": t}
                                                  for i, t in enumerate(item.candidates)])
                added += 1
        return added, len(new) - added

    def queued_sources(self, sources: Sequence[str], policy_version: int | None = None) -> set[str]:
        """Those of ``sources`` that some item already holds (one sampled by ``policy_version``, when given)."""
        found: set[str] = set()
        unique = list(dict.fromkeys(sources))
        with self.read() as conn:
            for start in range(0, len(unique), 500):
                query = select(items.c.source).where(items.c.source.in_(unique[start:start + 500]))
                if policy_version is not None:
                    query = query.where(items.c.policy_version == policy_version)
                found.update(conn.execute(query).scalars())
        return found

    def count_items(self) -> int:
        with self.read() as conn:
            return conn.execute(select(func.count()).select_from(items)).scalar_one()

    def item(self, item_id: int) -> Item:
        with self.read() as conn:
            return self._item(conn, item_id)

    def _item(self, conn: Connection, item_id: int) -> Item:
        row = conn.execute(select(items).where(items.c.id == item_id)).first()
        if row is None:
            raise NotFound(f"no item {item_id}")
        cands = conn.execute(select(candidates.c.id, candidates.c.position, candidates.c.text)
                             .where(candidates.c.item_id == item_id).order_by(candidates.c.position)).all()
        return Item(row.id, row.source, tuple(Candidate(c.id, c.position, c.text) for c in cands), row.ext_id,
                    row.origin)

    def _queue(self, annotator: Annotator, max_per_item: int):
        """Item ids in ``annotator``'s queue: not finished by them, and (with a cap) not judged by enough others.

        The cap counts judgements (ranked, rated) only: an item others skipped still needs its judgements. Two
        annotators served one item at once may both judge it (nothing is reserved)."""
        mine = annotations_table.alias("mine")
        query = (select(items.c.id)
                 .outerjoin(mine, and_(mine.c.item_id == items.c.id, mine.c.annotator_id == annotator.id))
                 .where(or_(mine.c.id.is_(None), mine.c.status.notin_(DONE))))
        if max_per_item > 0:
            finished = (select(func.count()).select_from(annotations_table)
                        .where(annotations_table.c.item_id == items.c.id, annotations_table.c.status.in_(JUDGED))
                        .scalar_subquery())
            # An item this annotator already started stays theirs to finish.
            query = query.where(or_(mine.c.id.is_not(None), finished < max_per_item))
        return query

    def next_item(self, annotator: Annotator, max_per_item: int = 0) -> Item | None:
        """The first item of the annotator's queue (in insertion order), or None when they are done."""
        with self.read() as conn:
            item_id = conn.execute(self._queue(annotator, max_per_item).order_by(items.c.id).limit(1)).scalar()
            return self._item(conn, item_id) if item_id is not None else None

    def progress(self, annotator: Annotator, max_per_item: int = 0) -> Progress:
        with self.read() as conn:
            left = conn.execute(select(func.count()).select_from(
                self._queue(annotator, max_per_item).subquery())).scalar_one()
            counts: dict[str, int] = dict(conn.execute(
                select(annotations_table.c.status, func.count()).where(annotations_table.c.annotator_id == annotator.id)
                .group_by(annotations_table.c.status)).all())
            flagged = conn.execute(select(func.count()).select_from(annotations_table).where(
                annotations_table.c.annotator_id == annotator.id, annotations_table.c.flagged.is_(True))).scalar_one()
        return Progress(done=sum(counts.get(s, 0) for s in DONE), left=left, skipped=counts.get("skipped", 0),
                        flagged=flagged)

    # --- annotations ---------------------------------------------------------------------------------------

    def submit(self, annotator: Annotator, sub: Submission) -> SubmitOutcome:
        """Apply one submission in one transaction (see the module docstring); idempotent by submission id."""
        digest = sub.digest()
        for attempt in range(3):
            try:
                with self.write() as conn:
                    return self._submit(conn, annotator, sub, digest)
            except IntegrityError:
                # A concurrent transaction inserted the same submission id or this annotator's annotation of
                # the item first (PostgreSQL; SQLite serialises writers): the next attempt sees its row.
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _submit(self, conn: Connection, annotator: Annotator, sub: Submission, digest: str) -> SubmitOutcome:
        seen = conn.execute(select(submissions).where(submissions.c.id == sub.submission_id)).first()
        if seen is not None:
            if seen.annotator_id != annotator.id or seen.digest != digest:
                raise SubmissionConflict(f"submission id {sub.submission_id!r} was already used for other content")
            return SubmitOutcome(self._annotation(conn, seen.annotation_id), duplicate=True)
        item = self._item(conn, sub.item_id)
        ids = [c.id for c in item.candidates]
        self._check(sub, ids)
        now = time.time()
        # FOR UPDATE (PostgreSQL; SQLite already holds the write lock): a concurrent submission of this annotator
        # to this item waits, then sees these labels (rating merges count complete ratings correctly).
        current = conn.execute(select(annotations_table.c.id, annotations_table.c.status,
                                      annotations_table.c.revision).where(
            annotations_table.c.annotator_id == annotator.id, annotations_table.c.item_id == item.id
        ).with_for_update()).first()
        revision = current.revision if current is not None else 0
        if sub.base_revision is not None and sub.base_revision != revision:
            raise StaleRevision(item.id, sub.base_revision, self._annotation(conn, current.id) if current else None)
        fields: dict[str, object] = {"submission_id": sub.submission_id, "updated_at": now, "revision": revision + 1}
        if sub.flagged is not None:
            fields["flagged"] = sub.flagged
        if sub.note is not None:
            fields["note"] = sub.note
        if current is None:
            new = {"flagged": False, "note": "", **fields}
            ann_id = conn.execute(insert(annotations_table).values(
                annotator_id=annotator.id, item_id=item.id, status="skipped", created_at=now, **new)
                .returning(annotations_table.c.id)).scalar_one()
            previous = None
        else:
            ann_id, previous = current.id, current.status
        if sub.action == "rate" and previous in ("rated", "partial"):
            # Ratings merge: the terminal stores each rating as it is typed.
            conn.execute(delete(labels).where(labels.c.annotation_id == ann_id,
                                              labels.c.candidate_id.in_(list(sub.ratings))))
        else:
            conn.execute(delete(labels).where(labels.c.annotation_id == ann_id))
        if sub.action == "rank":
            conn.execute(insert(labels), [{"annotation_id": ann_id, "candidate_id": c, "rank": r, "rating": None}
                                          for r, c in enumerate(sub.order)])
            status = "ranked"
        elif sub.action == "rate":
            conn.execute(insert(labels), [{"annotation_id": ann_id, "candidate_id": c, "rank": None, "rating": v}
                                          for c, v in sub.ratings.items()])
            rated = conn.execute(select(func.count()).select_from(labels).where(
                labels.c.annotation_id == ann_id, labels.c.rating.is_not(None))).scalar_one()
            status = "rated" if rated == len(ids) else "partial"
        else:
            status = "skipped"
        conn.execute(update(annotations_table).where(annotations_table.c.id == ann_id).values(status=status, **fields))
        conn.execute(insert(submissions).values(id=sub.submission_id, annotator_id=annotator.id, item_id=item.id,
                                                annotation_id=ann_id, digest=digest, created_at=now))
        return SubmitOutcome(self._annotation(conn, ann_id), duplicate=False)

    def _check(self, sub: Submission, ids: list[int]) -> None:
        if sub.action == "rank":
            if sorted(sub.order) != sorted(ids):
                raise InvalidSubmission("order", f"must list each of the item's candidate ids {sorted(ids)} once, "
                                                 f"best first; got {list(sub.order)}")
        elif sub.action == "rate":
            if not sub.ratings:
                raise InvalidSubmission("ratings", "rate at least one candidate")
            unknown = sorted(set(sub.ratings) - set(ids))
            if unknown:
                raise InvalidSubmission("ratings", f"candidate ids {unknown} are not in item {sub.item_id}")
            lo, hi = self.rating_range
            bad = {c: v for c, v in sub.ratings.items() if not lo <= v <= hi}
            if bad:
                raise InvalidSubmission("ratings", f"ratings must lie in [{lo}, {hi}]; got {bad}")
        if sub.action != "rank" and sub.order:
            raise InvalidSubmission("order", f"only a rank submission has an order (action={sub.action})")
        if sub.action != "rate" and sub.ratings:
            raise InvalidSubmission("ratings", f"only a rate submission has ratings (action={sub.action})")

    def _annotation(self, conn: Connection, ann_id: int) -> AnnotationRecord:
        row = conn.execute(select(annotations_table, annotators.c.name)
                           .join(annotators, annotators.c.id == annotations_table.c.annotator_id)
                           .where(annotations_table.c.id == ann_id)).first()
        if row is None:
            raise NotFound(f"no annotation {ann_id}")
        rows = conn.execute(select(labels.c.candidate_id, labels.c.rank, labels.c.rating)
                            .where(labels.c.annotation_id == ann_id)).all()
        order = tuple(r.candidate_id for r in sorted((r for r in rows if r.rank is not None), key=lambda r: r.rank))
        ratings = {r.candidate_id: r.rating for r in rows if r.rating is not None}
        return AnnotationRecord(row.id, row.item_id, row.name, row.status, bool(row.flagged), row.note, order,
                                ratings, row.updated_at, row.revision)

    def annotation(self, annotation_id: int, viewer: Annotator) -> AnnotationRecord:
        """An annotation its owner or an admin may read; anyone else gets NotFound (as if it did not exist)."""
        with self.read() as conn:
            owner = conn.execute(select(annotations_table.c.annotator_id)
                                 .where(annotations_table.c.id == annotation_id)).scalar()
            if owner is None or (owner != viewer.id and not viewer.is_admin):
                raise NotFound(f"no annotation {annotation_id}")
            return self._annotation(conn, annotation_id)

    def annotation_of(self, annotator: Annotator, item_id: int) -> AnnotationRecord | None:
        """``annotator``'s own annotation of an item (never another's)."""
        with self.read() as conn:
            ann_id = conn.execute(select(annotations_table.c.id).where(
                annotations_table.c.annotator_id == annotator.id, annotations_table.c.item_id == item_id)).scalar()
            return self._annotation(conn, ann_id) if ann_id is not None else None

    def annotations(self, viewer: Annotator, *, annotator: str | None = None, offset: int = 0,
                    limit: int = 50) -> tuple[list[AnnotationRecord], int]:
        """(a page of annotations newest first, total): the viewer's own; an admin's: everyone's or ``annotator``'s."""
        cond = []
        if not viewer.is_admin:
            cond.append(annotations_table.c.annotator_id == viewer.id)
        elif annotator is not None:
            cond.append(annotators.c.name == annotator)
        base = (select(annotations_table.c.id).join(annotators, annotators.c.id == annotations_table.c.annotator_id)
                .where(*cond))
        with self.read() as conn:
            total = conn.execute(select(func.count()).select_from(base.subquery())).scalar_one()
            ids = conn.execute(base.order_by(annotations_table.c.updated_at.desc(), annotations_table.c.id.desc())
                               .offset(offset).limit(limit)).scalars().all()
            return [self._annotation(conn, i) for i in ids], total

    # --- admin and export ----------------------------------------------------------------------------------

    def annotator_stats(self) -> list[AnnotatorStats]:
        with self.read() as conn:
            people = conn.execute(select(annotators.c.id, annotators.c.name, annotators.c.role)
                                  .order_by(annotators.c.name)).all()
            counts: dict[int, dict[str, int]] = {}
            for who, status, n in conn.execute(
                    select(annotations_table.c.annotator_id, annotations_table.c.status, func.count())
                    .group_by(annotations_table.c.annotator_id, annotations_table.c.status)):
                counts.setdefault(who, {})[status] = n
            flags: dict[int, int] = dict(conn.execute(
                select(annotations_table.c.annotator_id, func.count()).where(annotations_table.c.flagged.is_(True))
                .group_by(annotations_table.c.annotator_id)).all())
        stats = []
        for p in people:
            done = counts.get(p.id, {})
            stats.append(AnnotatorStats(p.name, p.role, ranked=done.get("ranked", 0), rated=done.get("rated", 0),
                                        partial=done.get("partial", 0), skipped=done.get("skipped", 0),
                                        flagged=flags.get(p.id, 0)))
        return stats

    def flagged(self, limit: int = 200) -> list[FlaggedItem]:
        with self.read() as conn:
            rows = conn.execute(
                select(annotations_table.c.id, annotations_table.c.item_id, annotators.c.name, items.c.source,
                       annotations_table.c.note)
                .join(annotators, annotators.c.id == annotations_table.c.annotator_id)
                .join(items, items.c.id == annotations_table.c.item_id)
                .where(annotations_table.c.flagged.is_(True)).order_by(annotations_table.c.id).limit(limit)).all()
        return [FlaggedItem(*r) for r in rows]

    def _labelled(self, statuses: Sequence[str], include_flagged: bool, annotator: str | None):
        """Rows (annotation id, annotator, item id, source, candidate id, text, rank, rating) in export order."""
        cond: list[ColumnElement[bool]] = [annotations_table.c.status.in_(list(statuses))]
        if not include_flagged:
            cond.append(annotations_table.c.flagged.is_(False))
        if annotator is not None:
            cond.append(annotators.c.name == annotator)
        return (select(annotations_table.c.id, annotators.c.name, items.c.id.label("item_id"), items.c.source,
                       candidates.c.id.label("candidate_id"), candidates.c.text, labels.c.rank, labels.c.rating)
                .select_from(labels)
                .join(annotations_table, annotations_table.c.id == labels.c.annotation_id)
                .join(annotators, annotators.c.id == annotations_table.c.annotator_id)
                .join(items, items.c.id == annotations_table.c.item_id)
                .join(candidates, candidates.c.id == labels.c.candidate_id)
                .where(*cond)
                .order_by(annotations_table.c.id, labels.c.rank, candidates.c.position))

    def rank_lists(self, *, include_flagged: bool = False, annotator: str | None = None
                   ) -> Iterator[tuple[str, list[str]]]:
        """(source, candidate texts best first) for every ranking, one per annotator and item, oldest first."""
        with self.read() as conn:
            current, source = None, ""
            texts: list[str] = []
            for row in conn.execute(self._labelled(["ranked"], include_flagged, annotator)):
                if row.id != current:
                    if current is not None:
                        yield source, texts
                    current, source, texts = row.id, row.source, []
                texts.append(row.text)
            if current is not None:
                yield source, texts

    def ratings(self, *, include_flagged: bool = False, annotator: str | None = None
                ) -> Iterator[tuple[str, str, float]]:
        """(source, candidate text, rating) for every rated candidate (of complete and partial ratings)."""
        with self.read() as conn:
            for row in conn.execute(self._labelled(["rated", "partial"], include_flagged, annotator)):
                yield row.source, row.text, row.rating

    def judgements(self) -> dict[int, dict[str, dict[int, float]]]:
        """For agreement: item id → annotator → candidate id → score (higher is better) over complete judgements:
        a ranking scores candidate at rank r as -r; a rating is its own score."""
        out: dict[int, dict[str, dict[int, float]]] = {}
        with self.read() as conn:
            for row in conn.execute(self._labelled(JUDGED, True, None)):
                score = -float(row.rank) if row.rank is not None else float(row.rating)
                out.setdefault(row.item_id, {}).setdefault(row.name, {})[row.candidate_id] = score
        return out


# --- migrations -------------------------------------------------------------------------------------------

def _alembic_config(conn: Connection):
    from alembic.config import Config as AlembicConfig

    config = AlembicConfig()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    return config


def _stamped_revision(store: Store) -> str | None:
    """The revision in the database's alembic_version table, read without alembic (None: no such table)."""
    with store.read() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def schema_revision(store: Store) -> str | None:
    """The database's schema revision (None: an empty database)."""
    from alembic.runtime.migration import MigrationContext

    with store.read() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    """The newest schema revision this code knows."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    assert head is not None
    return head


def upgrade(store: Store, revision: str = "head") -> None:
    """Upgrade the schema to ``revision`` in one transaction (a failed migration leaves the database as it was).

    Raises StoreError for a database whose revision this code does not know (a newer rlt2t migrated it).
    """
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    with store.write() as conn:
        if conn.dialect.name == "postgresql":
            # Concurrent openers of one database wait here; the loser finds the schema current.
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7426813)")
        config = _alembic_config(conn)
        current = MigrationContext.configure(conn).get_current_revision()
        script = ScriptDirectory.from_config(config)
        if current is not None and current not in {s.revision for s in script.walk_revisions()}:
            raise StoreError(f"{store.url}: schema revision {current!r} is unknown to this rlt2t (it knows up to "
                             f"{script.get_current_head()!r}); a newer rlt2t migrated this database")
        command.upgrade(config, revision)
    log.debug("annotation database %s at schema revision %s", store.url, revision)
