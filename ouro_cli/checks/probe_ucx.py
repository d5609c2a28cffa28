"""`ouro probe-ucx`: which UCX transport settings actually deliver bytes between two processes.

Why: UCX picks transports by itself, and a setting can report a WRITE as complete
while the bytes never reach the target (a wrong memory type, a transport that cannot
reach VRAM, a stale registration). The PD engine's KV transfers depend on this, so
the probe checks delivery on the receiving side, byte for byte:

    for each setting (UCX's default, "tcp,cuda_copy", and any given with --tls):
        two fresh spawned processes, each a NIXL agent with the UCX backend and
        UCX_TLS set before NIXL loads; the target registers a poisoned buffer (VRAM on
        its CUDA device, DRAM without CUDA), the initiator registers a buffer holding a
        salted pattern and WRITEs it with a notification, `repeats` times; the target
        waits for the notifications and compares every byte.

A setting passes only when the initiator saw completion AND the target got every
notification AND every byte matched; "completed but not delivered" is reported as
such. Each setting has a timeout, and both processes are always joined (killed if
they hang, which is then the result). The fastest setting that delivered is
recommended with the command line that applies it.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from ouro_cli import env

DEFAULT_SETTINGS: tuple[str | None, ...] = (None, "tcp,cuda_copy")  # None: UCX_TLS unset (UCX's own choice)


@dataclass
class SettingResult:
    tls: str | None
    status: str  # delivered | completed_not_delivered | failed | timeout
    completed: bool = False
    notified: int = 0
    bytes_checked: int = 0
    mismatched_bytes: int = 0
    seconds: list[float] = field(default_factory=list)
    gbps: float | None = None
    memory: str = ""
    error: str | None = None

    @property
    def label(self) -> str:
        return self.tls or "default"


def _pattern(n: int, salt: int):
    import torch

    i = torch.arange(n, dtype=torch.int64)
    return ((i * 131 + salt + (i >> 8) * 7) % 251 + 1).to(torch.uint8)  # never 0: the poison


def _buffer(n: int, device: str, fill: int | None, salt: int):
    import torch

    if fill is None:
        t = _pattern(n, salt)
    else:
        t = torch.full((n,), fill, dtype=torch.uint8)
    return t.to(device) if device != "cpu" else t


def _agent(name: str, tls: str | None):
    os.dup2(2, 1)  # NIXL and UCX log to stdout; `--json` promises stdout holds one JSON document
    env.put("UCX_TLS", tls)
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _target(conn, tls: str | None, device: str, size: int, repeats: int, salt: int, timeout: float) -> None:
    try:
        agent = _agent("probe-target", tls)
        buf = _buffer(size, device, 0, salt)  # poisoned: stale or missing bytes cannot pass
        agent.register_memory(buf)
        conn.send(("meta", agent.get_agent_metadata(), agent.get_serialized_descs(agent.get_xfer_descs(buf))))
        notified: set[bytes] = set()
        want = {f"probe-{i}".encode() for i in range(repeats)}
        deadline = time.monotonic() + timeout
        while not want <= notified and time.monotonic() < deadline:
            for msgs in agent.get_new_notifs().values():
                notified.update(msgs)
            time.sleep(0.001)
        got = buf.cpu()
        expected = _pattern(size, salt)
        mismatched = int((got != expected).sum())
        conn.send(("checked", len(want & notified), size, mismatched))
        conn.recv()  # hold the registration until the initiator is done
    except BaseException as err:  # noqa: BLE001
        conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc(limit=4)))


def _initiator(conn, tls: str | None, device: str, size: int, repeats: int, salt: int, timeout: float) -> None:
    try:
        agent = _agent("probe-initiator", tls)
        buf = _buffer(size, device, None, salt)
        agent.register_memory(buf)
        tag, meta, descs = conn.recv()
        remote = agent.add_remote_agent(meta)
        remote_descs = agent.deserialize_descs(descs)
        local_descs = agent.get_xfer_descs(buf)
        seconds, completed = [], True
        for i in range(repeats):
            handle = agent.initialize_xfer("WRITE", local_descs, remote_descs, remote, f"probe-{i}".encode())
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            seconds.append(time.perf_counter() - t0)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                completed = False
                conn.send(("done", False, seconds, f"transfer state {state}"))
                break
        else:
            conn.send(("done", completed, seconds, None))
        conn.recv()
    except BaseException as err:  # noqa: BLE001
        conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc(limit=4)))


def probe_setting(tls: str | None, devices: tuple[int, int], size: int, repeats: int, timeout: float) -> SettingResult:
    import torch
    import torch.multiprocessing as mp

    cuda = torch.cuda.is_available()
    dev_t, dev_i = (f"cuda:{devices[1]}", f"cuda:{devices[0]}") if cuda else ("cpu", "cpu")
    memory = "VRAM" if cuda else "DRAM"
    ctx = mp.get_context("spawn")
    salt = int.from_bytes(os.urandom(2), "little")
    (t_here, t_there), (i_here, i_there) = ctx.Pipe(), ctx.Pipe()
    target = ctx.Process(target=_target, args=(t_there, tls, dev_t, size, repeats, salt, timeout), daemon=True)
    initiator = ctx.Process(target=_initiator, args=(i_there, tls, dev_i, size, repeats, salt, timeout), daemon=True)
    result = SettingResult(tls=tls, status="failed", memory=memory)
    procs = (target, initiator)
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout + 30  # + start-up (spawn, torch and NIXL import)
        msg = _recv(t_here, target, deadline)
        if msg[0] != "meta":
            return _failed(result, "target", msg)
        i_here.send(msg)
        done = _recv(i_here, initiator, deadline)
        if done[0] != "done":
            return _failed(result, "initiator", done)
        result.completed, result.seconds = done[1], done[2]
        checked = _recv(t_here, target, deadline)
        if checked[0] != "checked":
            return _failed(result, "target", checked)
        result.notified, result.bytes_checked, result.mismatched_bytes = checked[1], checked[2], checked[3]
        delivered = result.notified == repeats and result.mismatched_bytes == 0
        if result.completed and delivered:
            result.status = "delivered"
            result.gbps = size / statistics.median(result.seconds) / 1e9
        elif result.completed:
            result.status = "completed_not_delivered"
            result.error = (
                f"initiator saw completion but the target got {result.notified}/{repeats} "
                f"notifications and {result.mismatched_bytes} of {size} bytes differ"
            )
        else:
            result.error = done[3]
        for conn in (t_here, i_here):
            conn.send("bye")
        return result
    except TimeoutError as err:
        result.status, result.error = "timeout", str(err)
        return result
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()


def _recv(conn, proc, deadline: float):
    while not conn.poll(0.05):
        if not proc.is_alive():
            if conn.poll(0):
                break
            return ("error", f"process exited with code {proc.exitcode}", "")
        if time.monotonic() > deadline:
            raise TimeoutError("no answer before the timeout (hung transfer or notification)")
    return conn.recv()


def _failed(result: SettingResult, who: str, msg: tuple) -> SettingResult:
    result.status = "failed"
    result.error = f"{who}: {msg[1]}" if len(msg) > 1 else f"{who}: {msg!r}"
    return result


def run_probe(
    settings: list[str | None],
    devices: tuple[int, int] = (0, 1),
    size: int = 64 << 20,
    repeats: int = 3,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Probe every setting; the document `probe.json` holds (results, recommendation)."""
    import torch

    results = [probe_setting(tls, devices, size, repeats, timeout) for tls in settings]
    delivered = [r for r in results if r.status == "delivered"]
    best = max(delivered, key=lambda r: r.gbps or 0.0) if delivered else None
    cuda = torch.cuda.is_available()
    return {
        "devices": list(devices) if cuda else ["cpu", "cpu"],
        "memory": "VRAM" if cuda else "DRAM",
        "bytes": size,
        "repeats": repeats,
        "results": [{**asdict(r), "label": r.label} for r in results],
        "recommended": None
        if best is None
        else {
            "tls": best.tls,
            "label": best.label,
            "gbps": best.gbps,
            "apply": ("ouro train ... (UCX_TLS unset)" if best.tls is None else f"UCX_TLS={best.tls} ouro train ...")
            + " --prefill-devices ... --decode-devices ...",
        },
    }
