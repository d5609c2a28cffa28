"""The KV cache's device memory: one flat buffer per K and V half, handed back while the engine idles.

A colocated run gives the cache's memory to the trainer for every train step and takes it
back for the next rollout (kv_cache.PagedKVCache.release/restore). Every CUDA graph the
engine captured (runner.py: decode steps, prefills) holds the cache's addresses, so a cache
that comes back elsewhere makes all of them stale, to be captured again in every update
(why: docs/performance.md#whole-update).

`ReservedBuffer` keeps the addresses. It reserves the buffer's virtual address range once,
at the cache's capacity, and backs a prefix of it with physical memory while the cache is
held (CUDA's virtual memory management: cuMemAddressReserve, cuMemCreate, cuMemMap), then
unmaps and frees that memory on release: the device gets every byte back, and the next
restore maps new memory at the same addresses, so the graphs captured on it replay as they
are. It calls the CUDA driver through NVIDIA's `cuda-bindings` package (PyTorch exposes no
such allocation); where that package is missing, where the device or driver cannot do
it, or off CUDA, `TorchBuffer` allocates through PyTorch as before, and the graphs are
captured again whenever the address moves (runner.ModelRunner keys its graphs by the
cache's layout, addresses included).

Contents never survive a release; a taken buffer is zeroed, so even slots no step wrote
hold finite values. PyTorch's memory statistics do not see the reserved buffers' memory:
`peak_mapped_bytes` counts it for the peaks a run records.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass
class _Mapped:
    """The reserved buffers' memory on one device, which PyTorch's allocator does not see, and
    the peaks a run records with it (rl/phases.py). PyTorch's own peaks are folded in and reset
    at every map and unmap, so the two are counted at the same moment: a peak of the
    allocator's before the cache was mapped (the optimizer state, say) never adds to the
    cache's."""

    now: int = 0  # bytes mapped now
    most: int = 0  # the most mapped since `reset_peak`
    needed: int = 0  # the most allocated + mapped at once, up to the last map or unmap
    held: int = 0  # the most reserved + mapped at once, likewise

    def fold(self, index: int) -> None:
        self.needed = max(self.needed, torch.cuda.max_memory_allocated(index) + self.now)
        self.held = max(self.held, torch.cuda.max_memory_reserved(index) + self.now)
        torch.cuda.reset_peak_memory_stats(index)


_MAPPED: dict[int, _Mapped] = {}


def peak_mapped_bytes(index: int) -> int:
    """The most bytes the reserved buffers on CUDA device `index` held at once since `reset_peak`."""
    return _MAPPED.get(index, _Mapped()).most


def mapped_bytes(index: int) -> int:
    """The bytes the reserved buffers on CUDA device `index` hold now."""
    return _MAPPED.get(index, _Mapped()).now


def peak_bytes(index: int) -> tuple[int, int]:
    """(needed, held) since `reset_peak` on CUDA device `index`, each at one moment: the most
    memory the process's tensors took (PyTorch's allocated bytes plus the mapped KV cache),
    and the most it held from the device (PyTorch's reserved segments, its cached blocks and
    CUDA-graph pools included, plus the mapped KV cache). The CUDA context is in neither."""
    mapped = _MAPPED.setdefault(index, _Mapped())
    mapped.fold(index)
    return mapped.needed, mapped.held


def reset_peak(index: int) -> None:
    """Start the peaks over (PyTorch's too) from what is held now."""
    torch.cuda.reset_peak_memory_stats(index)
    mapped = _MAPPED.setdefault(index, _Mapped())
    mapped.most = mapped.now
    mapped.needed = torch.cuda.memory_allocated(index) + mapped.now
    mapped.held = torch.cuda.memory_reserved(index) + mapped.now


def _count(index: int, nbytes: int) -> None:
    mapped = _MAPPED.setdefault(index, _Mapped())
    mapped.fold(index)
    mapped.now += nbytes
    mapped.most = max(mapped.most, mapped.now)


class TorchBuffer:
    """A flat buffer allocated through PyTorch's allocator on every `take`: its address may move."""

    fixed_address = False

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity, self.dtype, self.device = capacity, dtype, device

    def take(self, elements: int) -> torch.Tensor:
        """A zeroed tensor of `elements` (at most the capacity); the previous one must be dropped."""
        return torch.zeros(elements, dtype=self.dtype, device=self.device)

    def give_back(self) -> None:
        """Nothing to do: the memory goes when the caller drops its tensors."""

    def close(self) -> None:
        pass


class _Interface:
    """`__cuda_array_interface__` of a byte range, for torch.as_tensor (which keeps this object alive)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


class ReservedBuffer:
    """`capacity` elements of virtual address space reserved once; `take` maps physical memory
    under the first elements, `give_back` unmaps it and returns it to the device. Every `take`
    returns the same base address."""

    fixed_address = True

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        from cuda.bindings import driver

        self._cu, self.capacity, self.dtype, self.device = driver, capacity, dtype, device
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._index = index
        supported = self._call(
            driver.cuDeviceGetAttribute,
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            driver.CUdevice(index),
        )
        if not supported:
            raise RuntimeError(f"cuda:{index} does not support CUDA virtual memory management")
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self._prop = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        with torch.cuda.device(index):
            torch.empty(0, device=device)  # the device's primary context current on this thread
            self._granularity = self._call(
                driver.cuMemGetAllocationGranularity,
                prop,
                driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
            self._reserved = self._round(max(capacity, 1) * dtype.itemsize)
            self._base = self._call(driver.cuMemAddressReserve, self._reserved, 0, 0, 0)
        # the mapped memory's handle and size (None, 0 while given back), shared with the finalizer:
        # a buffer dropped without close() still gives its memory and its range back
        self._state = {"handle": None, "mapped": 0}
        self._finalizer = weakref.finalize(self, _free, driver, index, self._base, self._reserved, self._state)
        self._finalizer.atexit = False  # the process's exit frees it all

    def _round(self, nbytes: int) -> int:
        g = self._granularity
        return -(-nbytes // g) * g

    def _call(self, fn, *args):
        """A driver call -> its result (None where it returns only a status); an error raises,
        out of memory as torch.OutOfMemoryError (the run's phases report it in one line)."""
        err, *out = fn(*args)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            name = getattr(err, "name", str(err))
            if err == self._cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise torch.OutOfMemoryError(f"{fn.__name__}: out of device memory for the KV cache ({name})")
            raise RuntimeError(f"CUDA driver call {fn.__name__} failed: {name}")
        return out[0] if out else None

    def take(self, elements: int) -> torch.Tensor:
        """A zeroed tensor of the first `elements` (at most the capacity), at the reserved address."""
        if self._state["handle"] is not None:
            raise RuntimeError("ReservedBuffer.take while its memory is taken: give it back first")
        if elements > self.capacity:
            raise ValueError(f"asked for {elements} elements, the buffer reserves {self.capacity}")
        nbytes = self._round(max(elements, 1) * self.dtype.itemsize)
        cu = self._cu
        with torch.cuda.device(self._index):
            handle = self._call(cu.cuMemCreate, nbytes, self._prop, 0)
            try:
                self._call(cu.cuMemMap, self._base, nbytes, 0, handle, 0)
            except BaseException:
                self._call(cu.cuMemRelease, handle)
                raise
            self._state.update(handle=handle, mapped=nbytes)
            _count(self._index, nbytes)
            self._call(cu.cuMemSetAccess, self._base, nbytes, [self._access], 1)
            raw = torch.as_tensor(_Interface(int(self._base), nbytes), device=self.device)
        tensor = raw.view(self.dtype)[:elements]
        tensor.zero_()
        return tensor

    def give_back(self) -> None:
        """Unmap and free the taken memory once the device is done with it; the caller has dropped
        every tensor into it (a later access would fault)."""
        handle, mapped = self._state["handle"], self._state["mapped"]
        if handle is None:
            return
        cu = self._cu
        with torch.cuda.device(self._index):
            torch.cuda.synchronize(self._index)  # queued kernels may still read the cache
            self._call(cu.cuMemUnmap, self._base, mapped)
            self._call(cu.cuMemRelease, handle)
        _count(self._index, -mapped)
        self._state.update(handle=None, mapped=0)

    def close(self) -> None:
        """Give the memory back and free the address range."""
        self.give_back()
        if self._finalizer.detach() is not None:
            with torch.cuda.device(self._index):
                self._call(self._cu.cuMemAddressFree, self._base, self._reserved)


def _free(driver, index: int, base, reserved: int, state: dict) -> None:
    """A reserved buffer's memory and address range, freed when it is collected unclosed (its
    tensors went with the cache that held them); errors are ignored, as at interpreter exit.
    A collection that happens while a CUDA graph is being captured leaves them (a device
    synchronisation would break the capture)."""
    try:
        if torch.cuda.is_current_stream_capturing():
            return
        with torch.cuda.device(index):
            torch.cuda.synchronize(index)
            if state["handle"] is not None:
                driver.cuMemUnmap(base, state["mapped"])
                driver.cuMemRelease(state["handle"])
                _count(index, -state["mapped"])
            driver.cuMemAddressFree(base, reserved)
    except Exception:
        pass


def device_buffer(capacity: int, dtype: torch.dtype, device: torch.device, fixed_address: bool | None = None):
    """The buffer for one half of a KV cache: `ReservedBuffer` on CUDA where cuda-bindings is
    installed and the device and driver support it (`fixed_address` None or True), else
    `TorchBuffer`. `fixed_address=True` where it cannot be had raises."""
    want = device.type == "cuda" if fixed_address is None else fixed_address
    if not want:
        return TorchBuffer(capacity, dtype, device)
    if device.type != "cuda":
        raise ValueError("a KV cache at a fixed address needs a CUDA device")
    try:
        return ReservedBuffer(capacity, dtype, device)
    except ImportError:
        if fixed_address:
            raise ImportError(
                "a KV cache at a fixed address needs NVIDIA's cuda-bindings package (pip install 'ouro-cli[cuda]')"
            ) from None
    except Exception:  # a driver without virtual memory management, bindings for another CUDA
        if fixed_address:
            raise
    return TorchBuffer(capacity, dtype, device)
