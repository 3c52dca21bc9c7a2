"""The floor that inference, the bench and training all read: the bench's prompt sets and
their data (`prompts`), the ShareGPT reader (`sharegpt`), training example sources and the
filter that keeps the bench's prompts out of them (`examples`), and the draft vocabulary
(`vocab`). It imports nothing of specdecode but `errors`.
"""
