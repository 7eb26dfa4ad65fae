"""annotations.revision: how many submissions an annotation has taken, so that a page submitting over an
annotation changed elsewhere since it loaded it (another tab, another machine) is told (409) instead of
replacing it unseen. Existing annotations start at 1.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("annotations") as batch:
        batch.add_column(sa.Column("revision", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("annotations") as batch:
        batch.drop_column("revision")
