"""Errors for people: raised at the boundary (API, CLI, server), each saying what was wrong and
what is allowed. The CLI prints a `UserError` in one line; any other exception is a bug and
keeps its traceback."""

from __future__ import annotations


class UserError(ValueError):
    """A problem the user can fix: bad input (a parameter, a prompt, a config), a missing model
    or library, a failed download. A ValueError, so `except ValueError` still catches it."""


class ModelNotFoundError(UserError, FileNotFoundError):
    """A model alias that is not pulled, or a path that holds no model."""


class MissingDependencyError(UserError, ImportError):
    """An optional library a feature needs is not installed; the message says what to install."""


def prompt_too_long(num_prompt: int, context: int) -> UserError:
    """The error for a prompt that alone fills the model's context (a request, the server's
    400 and `specdecode generate` say the same)."""
    return UserError(
        f"the prompt has {num_prompt} tokens but the model's context is {context} tokens "
        "(prompt + generated tokens must fit); shorten the prompt"
    )


def context_overflow(context: int, num_prompt: int, max_tokens: int) -> UserError:
    """The error for a request whose prompt + max_tokens exceed the model's context: the
    server's 400 and `specdecode generate` say the same."""
    return UserError(
        f"this model's maximum context length is {context} tokens, but "
        f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, {max_tokens} in "
        "the completion); reduce the prompt or max_tokens"
    )
