"""The two kinds of failure a command reports without a traceback.

`UserError`: bad usage or input (exit 2) — one line saying what is wrong and how to fix it.
`CheckFailed`: the command ran and a check it exists for failed (exit 1).
`ResourceError`: the command could not finish because a resource ran out or failed
(device memory, disk space, a killed writer process) — exit 1, one line naming the phase,
the sizes involved and the option to change.
`SettingError` is the UserError of a bad execution setting (ouro_cli/settings.py: an option or
the OURO_* variable that stands in for it; also a ValueError,
for library callers).
`Interrupted`: a command stopped by SIGINT or SIGTERM — exit 128 + the signal (130, 143), one
line saying where it stopped and how to continue. Like KeyboardInterrupt it is a
BaseException: it may be raised anywhere (cli/signals.py, rl/stop.py), and no
`except Exception` of a library or a plugin may take it for an error of its own.
"""


class UserError(Exception):
    exit_code = 2


class CheckFailed(Exception):
    exit_code = 1


class ResourceError(Exception):
    exit_code = 1


class SettingError(UserError, ValueError):
    pass


class Interrupted(BaseException):
    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
