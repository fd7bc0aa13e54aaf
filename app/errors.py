"""The error localchat's commands print as one line (exit status 2)."""


class UserError(Exception):
    """A problem the user can fix; the message says how."""
