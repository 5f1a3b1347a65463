"""config (see docs/DESIGN)."""
