"""megatron-core's torch_dist bucket writer, run in threads of this process (see
:mod:`ferrule.megatron.checkpoint`, whose :func:`~ferrule.megatron.checkpoint.save_sharded` uses it).

megatron-core 0.16.1 writes each bucket of a rank's tensors in a forked process
(``FileSystemWriterAsync.write_preloaded_data_multiproc``) and collects the results through a
spawn-method ``multiprocessing.Manager`` queue; a killed trainer left those forks alive, and the
Manager needs an ``if __name__ == "__main__":`` guard. :func:`in_process_writer` swaps both for
in-process equivalents during one synchronous save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["in_process_writer"]


def _write_buckets_in_threads(transform_list: list, use_msc: bool, rank: int, write_buckets: list,
                              global_results_queue: Any) -> None:
    """In-process stand-in for ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (megatron-core 0.16.1).

    Same arguments and the same result on ``global_results_queue`` (``{bucket index: [WriteResult]}``
    or the first bucket's exception), but each bucket is written by megatron's own
    ``write_preloaded_data`` in a thread of this process instead of a forked child, so nothing
    survives this process (module docstring).
    """
    import inspect
    import queue
    import threading

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    local_results: queue.Queue = queue.Queue()
    count_queue: queue.Queue = queue.Queue()
    extra = {}
    if use_msc and len(inspect.signature(FileSystemWriterAsync.write_preloaded_data).parameters) > 6:
        extra["use_msc"] = use_msc
    threads = []
    for i, bucket in enumerate(write_buckets):
        count_queue.put(i)
        threads.append(threading.Thread(
            target=FileSystemWriterAsync.write_preloaded_data, args=(transform_list,),
            kwargs=dict(local_proc_idx=i, write_bucket=bucket, results_queue=local_results,
                        count_queue=count_queue, use_fsync=True, **extra),
            name=f"ferrule-ckpt-writer-{rank}-{i}", daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results: dict | BaseException = {}
    while not local_results.empty():
        idx, out = local_results.get()
        if isinstance(out, BaseException):
            results = out
            break
        results[idx] = out
    if isinstance(results, dict) and len(results) != len(write_buckets):
        results = RuntimeError(f"checkpoint writer: {len(results)} of {len(write_buckets)} buckets reported")
    global_results_queue.put(results)


@contextlib.contextmanager
def in_process_writer() -> Iterator[None]:
    """Give megatron's torch_dist writer an in-process results queue and in-process bucket writers
    for one synchronous save (module docstring); the previous queue and writer are put back afterwards."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writer_cls = filesystem_async.FileSystemWriterAsync
    if (not hasattr(filesystem_async, "_results_queue")  # checked against megatron-core 0.16.1
            or not hasattr(writer_cls, "write_preloaded_data_multiproc")
            or not hasattr(writer_cls, "write_preloaded_data")):
        raise RuntimeError("megatron.core.dist_checkpointing.strategies.filesystem_async has no _results_queue or "
                           "FileSystemWriterAsync.write_preloaded_data(_multiproc); this megatron-core version "
                           "writes checkpoints differently: update save_sharded.")
    previous_queue = filesystem_async._results_queue
    previous_writer = writer_cls.__dict__["write_preloaded_data_multiproc"]
    filesystem_async._results_queue = queue.Queue()
    writer_cls.write_preloaded_data_multiproc = staticmethod(_write_buckets_in_threads)
    try:
        yield
    finally:
        filesystem_async._results_queue = previous_queue
        writer_cls.write_preloaded_data_multiproc = previous_writer
