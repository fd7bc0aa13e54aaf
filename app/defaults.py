"""Defaults the page, the API and `localchat run` share (no imports: the command line reads them
before anything heavy loads)."""

# The answer budget a chat, an API request or `localchat run` gets unless told otherwise: both
# families reason before they answer, often for a few thousand tokens, and the engine caps any
# budget at the room the context has left.
ANSWER_TOKENS = 8192
