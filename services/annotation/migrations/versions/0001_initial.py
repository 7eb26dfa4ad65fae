"""Initial annotation schema: annotators, sessions, items, candidates, annotations, labels, submissions.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "annotators",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_annotators"),
        sa.UniqueConstraint("name", name="uq_annotators_name"),
        sa.UniqueConstraint("token_sha256", name="uq_annotators_token_sha256"),
    )
    op.create_table(
        "sessions",
        sa.Column("id_sha256", sa.String(64), nullable=False),
        sa.Column("annotator_id", sa.Integer(), nullable=False),
        sa.Column("csrf_token", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["annotator_id"], ["annotators.id"], ondelete="CASCADE",
                                name="fk_sessions_annotator_id_annotators"),
        sa.PrimaryKeyConstraint("id_sha256", name="pk_sessions"),
    )
    op.create_index("ix_sessions_annotator_id", "sessions", ["annotator_id"])
    op.create_table(
        "items",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("content_sha256", sa.String(64), nullable=False),
        sa.Column("ext_id", sa.String(200), nullable=True),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("origin", sa.String(500), nullable=False),
        sa.Column("policy_version", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_items"),
        sa.UniqueConstraint("content_sha256", name="uq_items_content_sha256"),
    )
    op.create_table(
        "candidates",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("item_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["item_id"], ["items.id"], ondelete="CASCADE", name="fk_candidates_item_id_items"),
        sa.PrimaryKeyConstraint("id", name="pk_candidates"),
        sa.UniqueConstraint("item_id", "position", name="uq_candidates_item_id_position"),
    )
    op.create_table(
        "annotations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("annotator_id", sa.Integer(), nullable=False),
        sa.Column("item_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("flagged", sa.Boolean(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("submission_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["annotator_id"], ["annotators.id"], ondelete="CASCADE",
                                name="fk_annotations_annotator_id_annotators"),
        sa.ForeignKeyConstraint(["item_id"], ["items.id"], ondelete="CASCADE", name="fk_annotations_item_id_items"),
        sa.PrimaryKeyConstraint("id", name="pk_annotations"),
        sa.UniqueConstraint("annotator_id", "item_id", name="uq_annotations_annotator_id_item_id"),
    )
    op.create_index("ix_annotations_item_id", "annotations", ["item_id"])
    op.create_table(
        "labels",
        sa.Column("annotation_id", sa.Integer(), nullable=False),
        sa.Column("candidate_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("rating", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["annotation_id"], ["annotations.id"], ondelete="CASCADE",
                                name="fk_labels_annotation_id_annotations"),
        sa.ForeignKeyConstraint(["candidate_id"], ["candidates.id"], ondelete="CASCADE",
                                name="fk_labels_candidate_id_candidates"),
        sa.PrimaryKeyConstraint("annotation_id", "candidate_id", name="pk_labels"),
    )
    op.create_table(
        "submissions",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("annotator_id", sa.Integer(), nullable=False),
        sa.Column("item_id", sa.Integer(), nullable=False),
        sa.Column("annotation_id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["annotator_id"], ["annotators.id"], ondelete="CASCADE",
                                name="fk_submissions_annotator_id_annotators"),
        sa.ForeignKeyConstraint(["item_id"], ["items.id"], ondelete="CASCADE", name="fk_submissions_item_id_items"),
        sa.ForeignKeyConstraint(["annotation_id"], ["annotations.id"], ondelete="CASCADE",
                                name="fk_submissions_annotation_id_annotations"),
        sa.PrimaryKeyConstraint("id", name="pk_submissions"),
    )


def downgrade() -> None:
    for table in ("submissions", "labels", "annotations", "candidates", "items", "sessions", "annotators"):
        op.drop_table(table)
