"""opkd-mcore: on-policy knowledge distillation on Megatron-core (see DESIGN in the docs)."""

__version__ = "0.1.0"
