"""Shipped policies, one per model family."""
