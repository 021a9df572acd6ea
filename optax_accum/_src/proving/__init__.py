"""Proving a user's train step: k-invariance and replicas (see k_invariance)."""
