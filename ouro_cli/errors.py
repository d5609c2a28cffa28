"""The two kinds of failure a command reports without a traceback.

`UserError`: bad usage or input (exit 2) — one line saying what is wrong and how to fix it.
`CheckFailed`: the command ran and a check it exists for failed (exit 1).
`ResourceError`: the command could not finish because a resource ran out or failed
(device memory, disk space, a killed writer process) — exit 1, one line naming the phase,
the sizes involved and the option to change.
`DeviceFault`: the GPU reported an error (an illegal address, a device-side assert) — a
ResourceError naming the phase; the CUDA context is lost, so the process ends at once after
its line (cli/common.py), without touching the device again. `is_device_fault` tells such
an error from others without importing torch.
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


class DeviceFault(ResourceError):
    pass


def is_device_fault(err: BaseException) -> bool:
    """Whether `err` is the GPU's error (not an out-of-memory, which leaves the device usable)."""
    if isinstance(err, DeviceFault):
        return True
    if type(err).__name__ == "OutOfMemoryError":
        return False
    text = str(err)
    return type(err).__name__ == "AcceleratorError" or (
        isinstance(err, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)
    )


def device_fault_line(where: str, err: BaseException) -> str:
    """The one line of a GPU error in `where`: what the device said, what is left, how to see more."""
    said = str(err).splitlines()[0].strip() if str(err).strip() else type(err).__name__
    said = said.removeprefix("CUDA error: ")
    return (
        f"CUDA error in {where}: {said}. Nothing of the update in progress was saved: `ouro resume` "
        "continues from the run's last checkpoint (or starts it again if none was saved). To name the failing kernel, "
        "run again "
        "with `ouro --debug` and CUDA_LAUNCH_BLOCKING=1 (OURO_CHECK_KERNELS=1 also checks the attention "
        "kernels' indices)"
    )
