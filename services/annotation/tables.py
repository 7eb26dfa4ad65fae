"""The annotation database's tables (SQLAlchemy Core). The schema itself is created and changed only by the
alembic migrations in ``migrations/versions``; a test checks that they produce exactly these tables.

No ``from __future__ import annotations`` here: it binds the module name ``annotations``, which is a table."""

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData(naming_convention={
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
})

annotators = Table(
    "annotators", metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(64), nullable=False, unique=True),
    Column("role", String(16), nullable=False),
    Column("token_sha256", String(64), nullable=False, unique=True),
    Column("created_at", Float, nullable=False),
)
sessions = Table(
    "sessions", metadata,
    Column("id_sha256", String(64), primary_key=True),
    Column("annotator_id", Integer, ForeignKey("annotators.id", ondelete="CASCADE"), nullable=False, index=True),
    Column("csrf_token", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
)
items = Table(
    "items", metadata,
    Column("id", Integer, primary_key=True),
    Column("content_sha256", String(64), nullable=False, unique=True),
    Column("ext_id", String(200), nullable=True),
    Column("source", Text, nullable=False),
    Column("origin", String(500), nullable=False),
    Column("policy_version", Integer, nullable=True),
    Column("created_at", Float, nullable=False),
)
candidates = Table(
    "candidates", metadata,
    Column("id", Integer, primary_key=True),
    Column("item_id", Integer, ForeignKey("items.id", ondelete="CASCADE"), nullable=False),
    Column("position", Integer, nullable=False),
    Column("text", Text, nullable=False),
    UniqueConstraint("item_id", "position"),
)
annotations = Table(
    "annotations", metadata,
    Column("id", Integer, primary_key=True),
    Column("annotator_id", Integer, ForeignKey("annotators.id", ondelete="CASCADE"), nullable=False),
    Column("item_id", Integer, ForeignKey("items.id", ondelete="CASCADE"), nullable=False, index=True),
    Column("status", String(16), nullable=False),
    Column("flagged", Boolean, nullable=False),
    Column("note", Text, nullable=False),
    Column("submission_id", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    # Submissions applied so far: a page sends the revision it saw (409 when another tab has moved it on).
    Column("revision", Integer, nullable=False, server_default="1"),
    UniqueConstraint("annotator_id", "item_id"),
)
labels = Table(
    "labels", metadata,
    Column("annotation_id", Integer, ForeignKey("annotations.id", ondelete="CASCADE"), primary_key=True),
    Column("candidate_id", Integer, ForeignKey("candidates.id", ondelete="CASCADE"), primary_key=True),
    Column("rank", Integer, nullable=True),
    Column("rating", Float, nullable=True),
)
submissions = Table(
    "submissions", metadata,
    Column("id", String(64), primary_key=True),
    Column("annotator_id", Integer, ForeignKey("annotators.id", ondelete="CASCADE"), nullable=False),
    Column("item_id", Integer, ForeignKey("items.id", ondelete="CASCADE"), nullable=False),
    Column("annotation_id", Integer, ForeignKey("annotations.id", ondelete="CASCADE"), nullable=False),
    Column("digest", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
)
