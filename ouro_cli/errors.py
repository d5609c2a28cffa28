"""The two kinds of failure a command reports without a traceback.

`UserError`: bad usage or input (exit 2) — one line saying what is wrong and how to fix it.
`CheckFailed`: the command ran and a check it exists for failed (exit 1).
`ResourceError`: the command could not finish because a resource ran out or failed
(device memory, disk space, a killed writer process) — exit 1, one line naming the phase,
the sizes involved and the option to change.
`SettingError` is the UserError of a bad OURO_* environment switch (also a ValueError,
for library callers).
"""


class UserError(Exception):
    exit_code = 2


class CheckFailed(Exception):
    exit_code = 1


class ResourceError(Exception):
    exit_code = 1


class SettingError(UserError, ValueError):
    pass
