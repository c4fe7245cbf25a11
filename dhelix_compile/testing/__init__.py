"""Models and helpers for testing dhelix (and for users checking their own setups)."""
