"""Human annotation of policy candidates (docs/design.md, learned rewards): the web app, the terminal loop,
their database and the exports the reward-model trainer reads.

- ``store``: SQLAlchemy tables, migrations (alembic), every read and write, one transaction per submission.
- ``items``: items (a source and K candidates) from a candidates JSONL file or sampled from a policy server.
- ``app``: the FastAPI app (``create_app(cfg)``), its pages, JSON API and static files; ``schemas``: its bodies.
- ``terminal``: the seed tutorial's terminal loop (prompt, result, "Reward (-2.0 ~ 2.0):").
- ``export``: rank-list TSV, pairs JSONL and ratings JSONL; ``agreement``: Kendall's τ between annotators.
- ``scripted``: an annotator that ranks by a score function (tests and the example loop stand it in for people).
"""
