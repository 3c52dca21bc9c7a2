"""Structured output: constraints (JSON schema, JSON object, regex, choice, EBNF grammar) that
every generated token must keep, with speculation staying exact.

`params.py` holds the user-facing `StructuredOutputsParams` (no heavy imports); `grammars.py`
compiles them with xgrammar for one tokenizer; `state.py` is one request's place in its grammar;
`drafts.py` checks drafts against the grammar and builds the masks the verifier applies.
"""
