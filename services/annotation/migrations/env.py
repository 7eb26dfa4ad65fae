"""alembic environment of the annotation database: migrations run on the connection Store.upgrade hands over
(inside its transaction and lock), never on a URL of their own."""

from alembic import context

from rlt2t.services.annotation.tables import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run annotation migrations through rlt2t.services.annotation.store.upgrade(store)")

# render_as_batch: SQLite alters a table by copying it; later migrations stay portable.
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
