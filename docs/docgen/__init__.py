"""The pieces of docs/generate.py (run that script; these modules are its parts)."""
