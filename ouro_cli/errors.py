"""The two kinds of failure a command reports without a traceback.

`UserError`: bad usage or input (exit 2) — one line saying what is wrong and how to fix it.
`CheckFailed`: the command ran and a check it exists for failed (exit 1).
"""


class UserError(Exception):
    exit_code = 2


class CheckFailed(Exception):
    exit_code = 1
