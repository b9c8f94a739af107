"""Shipped policies, one per model family (installed as sage_patch.configs)."""
