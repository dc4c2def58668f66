"""An outlet that runs before footer's (priority 5 against 10, though "footer" sorts first by
id): footer then sees the stamp and appends after it."""

from localm import sdk


@sdk.hookimpl
def chat_outlet(response):
    response["content"] += " [stamp]"  # a change in place counts as returning it
