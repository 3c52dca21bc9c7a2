"""Drafters: anything that proposes tokens for the target to verify."""
