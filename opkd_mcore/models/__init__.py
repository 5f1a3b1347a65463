"""models (see docs/DESIGN)."""
