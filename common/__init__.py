"""rlt2t."""
