"""rollout (see docs/DESIGN)."""
