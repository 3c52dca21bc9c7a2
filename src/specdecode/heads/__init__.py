"""Trained draft heads that read the target's hidden states (EAGLE-3): config, module, files."""
