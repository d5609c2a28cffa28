"""A synchronous dist-checkpoint save that keeps its write results in the saving process.

megatron-core's torch_dist writer passes a save's write results (which files hold which
tensors) back through one queue per process, served by a `multiprocessing` Manager: a spawned
interpreter that imports torch to unpickle them. The writer starts that manager on the
process's first save, synchronous or not. A synchronous save writes its files (in forked
writer processes) and reads the results back in the process that saves, so an in-process
queue serves it and nothing is spawned; the files written are the same.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator


@contextlib.contextmanager
def in_process_results() -> Iterator[None]:
    """Serve the enclosed synchronous saves' write results from an in-process queue.

    Only while megatron has no results queue yet: once a background save started the
    manager, a writer process of that save may still put into it, so it is left as it is.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None
