"""Training of draft heads on the target's own states (`specdecode train`)."""
