"""alembic environment of the annotation database: migrations run on the connection Store.upgrade hands over
(inside its transaction and lock), never on a URL of their own.

A schema change: change ``tables.py``, add ``versions/000N_<what>.py`` (``revision = "000N"``,
``down_revision`` the previous one; ``script.py.mako`` is its skeleton, ``op.batch_alter_table`` for SQLite)
and set ``store.SCHEMA_HEAD``. The store tests check, on SQLite and PostgreSQL, that the migrations build
exactly ``tables.py`` and that SCHEMA_HEAD is alembic's head.
"""

from alembic import context

from rlt2t.services.annotation.tables import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run annotation migrations through rlt2t.services.annotation.store.upgrade(store)")

# render_as_batch: SQLite alters a table by copying it; later migrations stay portable.
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
