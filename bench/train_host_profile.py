"""`ouro train` with a cProfile of one rollout: where the job's host time goes while it decodes.

    python bench/train_host_profile.py UPDATE OUT.pstats train --model ... (ouro train's arguments)

Runs the command line exactly as `python -m ouro_cli.cli.app` does, with the engine's
`LLM.generate` profiled at its UPDATE-th call (0-based: with no held-out evaluation, the
rollout of update UPDATE) and the statistics written to OUT.pstats (`pstats.Stats` reads
them). bench/e2e.py `--host-profile UPDATE` runs it and prints the top functions beside the
decode steps they covered, to compare with `bench/decode_profile.py --host-profile`, which
profiles the same engine decoding alone (docs/log/performance.md, 2026-12-02: the job's K = 2 rollout
phase took 18 ms per decode step where the benchmark's loop takes about 7; this profile put
the difference in the prefill). Only the profiled call slows down.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def wrap_call(owner: type, name: str, index: int, around) -> None:
    """Make `owner.name`'s `index`-th call (0-based, counted over the process) run as
    `around(instance, call)`, where `call()` runs it; every other call runs as it is. Shared
    with bench/train_step_profile.py."""
    plain = getattr(owner, name)
    calls = [0]

    def wrapped(self, *args, **kwargs):
        at, calls[0] = calls[0], calls[0] + 1
        if at != index:
            return plain(self, *args, **kwargs)
        return around(self, lambda: plain(self, *args, **kwargs))

    setattr(owner, name, wrapped)


def profile_call(update: int, out: str) -> None:
    """Wrap LLM.generate so that its `update`-th call runs under cProfile, dumped to `out`."""
    from ouro_cli.engine.engine import LLM

    def around(_llm, call):
        prof = cProfile.Profile()
        prof.enable()
        try:
            return call()
        finally:
            prof.disable()
            prof.dump_stats(out)

    wrap_call(LLM, "generate", update, around)


def run_ouro(usage: str, profile) -> None:
    """`python SCRIPT UPDATE OUT <ouro arguments>`: `profile(UPDATE, OUT)` installs the wrapper,
    then the command line runs as `python -m ouro_cli.cli.app` runs it."""
    if len(sys.argv) < 4:
        raise SystemExit(usage)
    profile(int(sys.argv[1]), sys.argv[2])
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    from ouro_cli.cli.app import main as ouro

    ouro()


def print_top(source, top: int, indent: str) -> None:
    """The `top` functions of a profile (a cProfile.Profile or a pstats file), by own time and by
    cumulative time, each line after `indent` (shared with bench/decode_profile.py)."""
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(source, stream=text).sort_stats(order).print_stats(top)
        lines = [x for x in text.getvalue().splitlines() if x.strip()]
        print(f"{indent}by {order}:")
        for line in lines[-top - 1 :]:
            print(f"{indent}  {line[:160]}")


def main() -> None:
    run_ouro(__doc__, profile_call)


if __name__ == "__main__":
    main()
