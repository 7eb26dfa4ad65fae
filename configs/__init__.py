"""Example configs that ship with rlt2t: `--config tiny` (or a path) on any command."""
