"""Checksums of GPU sources computed on the GPU while their snapshot is copied to the host.

xxHash's own ``XXH3_64bits`` (its header, copied beside the native libraries at build time) is
compiled for the GPU with NVRTC (``cuda.bindings.nvrtc``) in the background, from when the
engine is made (where CUDA is initialized by then) or first copies on a device; eight threads
hash one block of :data:`GPU_SUM_BLOCK` bytes, one accumulator lane each (xxHash's own
functions for the short inputs and the final merge). The digests equal those of
``libdcp_hash.so`` and the xxhash package, so a load verifies them as any other. The kernel
runs on a stream of its own, beside the copies (it reads the sources in GPU memory, they read
them over PCIe): the commit then need not read the snapshot's bytes again to checksum them
(a faster memory commit: ``benchmarks/RESULTS.md`` at 1d2b20c). Until
the kernel is built, or where it cannot be, the commit hashes on the CPU (said once in the log).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    from cuda.bindings import driver, nvrtc
    from cuda.bindings import runtime as cudart
except (ImportError, OSError):  # no cuda-python: nothing here is used
    driver = nvrtc = cudart = None

log = logging.getLogger("dcp_datastates")

#: Bytes one group of eight GPU threads hashes (one checksum): larger blocks leave too few
#: threads to fill the GPU; smaller ones multiply the checksums the metadata holds.
GPU_SUM_BLOCK = 1 << 20
HEADER = Path(__file__).resolve().parent.parent / "_lib" / "xxhash.h"
_THREADS = 128

_KERNEL = b"""
#define XXH_INLINE_ALL
#define XXH_VECTOR 0
#define XXH_CPU_LITTLE_ENDIAN 1
#define XXH_DEBUGLEVEL 0
#include "xxhash.h"

/* XXH3_64bits of inputs over 240 bytes (XXH3_hashLong_64b_internal with the default secret)
 * by 8 threads, one accumulator lane each: a stripe of 64 bytes is one coalesced load per
 * group. Shorter inputs: xxHash's own function on the group's first thread. */
template <bool Aligned>
__device__ __forceinline__ xxh_u64 dsh_load(const xxh_u8 *p) {
    if constexpr (Aligned)
        return *(const xxh_u64 *)p;
    else
        return XXH_readLE64(p);
}

__device__ __forceinline__ xxh_u64 dsh_stripe(xxh_u64 acc, xxh_u64 data, xxh_u64 key,
                                              unsigned int mask) {
    key ^= data;
    acc += __shfl_xor_sync(mask, data, 1, 8);
    return acc + XXH_mult32to64(key & 0xFFFFFFFF, key >> 32);
}

/* The accumulator lane of this thread after the blocks and stripes of XXH3's long loop (the
 * last stripe aside); a stripe's 16 loads are issued before its arithmetic. */
template <bool Aligned>
__device__ xxh_u64 dsh_long(const xxh_u8 *in, size_t len, unsigned int lane, unsigned int mask,
                            const xxh_u64 *keys, xxh_u64 scramble, xxh_u64 acc) {
    size_t const block_len = 16 * XXH_STRIPE_LEN, nb_blocks = (len - 1) / block_len;
    for (size_t b = 0; b < nb_blocks; b++) {
        const xxh_u8 *p = in + b * block_len + 8 * lane;
        xxh_u64 data[16];
#pragma unroll
        for (int s = 0; s < 16; s++)
            data[s] = dsh_load<Aligned>(p + s * XXH_STRIPE_LEN);
#pragma unroll
        for (int s = 0; s < 16; s++)
            acc = dsh_stripe(acc, data[s], keys[s], mask);
        acc = (XXH_xorshift64(acc, 47) ^ scramble) * XXH_PRIME32_1;
    }
    size_t const stripes = ((len - 1) - block_len * nb_blocks) / XXH_STRIPE_LEN;
    const xxh_u8 *p = in + nb_blocks * block_len + 8 * lane;
    for (size_t s = 0; s < stripes; s++)
        acc = dsh_stripe(acc, dsh_load<Aligned>(p + s * XXH_STRIPE_LEN), keys[s], mask);
    return acc;
}

/* blocks[0:n]: addresses, blocks[n:2n]: lengths, blocks[2n:3n]: their digests (pinned host
 * memory, read and written in place) */
extern "C" __global__ void dsh_xxh3_blocks(unsigned long long *blocks, unsigned int n) {
    unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int lane = threadIdx.x & 7;
    unsigned int mask = 0xFFu << (threadIdx.x & 24);
    if ((t >> 3) >= n)
        return;  /* whole groups only: n groups fill the grid's first 8n threads */
    unsigned int g = (unsigned int)(t >> 3);
    const xxh_u8 *in = (const xxh_u8 *)blocks[g];
    size_t len = (size_t)blocks[n + g];
    if (len <= XXH3_MIDSIZE_MAX) {
        if (lane == 0)
            blocks[2ull * n + g] = XXH3_64bits(in, len);
        return;
    }
    const xxh_u64 init[8] = XXH3_INIT_ACC;
    const xxh_u8 *secret = XXH3_kSecret;
    xxh_u64 keys[16];
#pragma unroll
    for (int s = 0; s < 16; s++)
        keys[s] = XXH_readLE64(secret + s * XXH_SECRET_CONSUME_RATE + 8 * lane);
    xxh_u64 const scramble = XXH_readLE64(secret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN
                                          + 8 * lane);
    xxh_u64 const last = XXH_readLE64(secret + XXH_SECRET_DEFAULT_SIZE - XXH_STRIPE_LEN
                                      - XXH_SECRET_LASTACC_START + 8 * lane);
    xxh_u64 acc = ((unsigned long long)in & 7) == 0
        ? dsh_long<true>(in, len, lane, mask, keys, scramble, init[lane])
        : dsh_long<false>(in, len, lane, mask, keys, scramble, init[lane]);
    acc = dsh_stripe(acc, XXH_readLE64(in + len - XXH_STRIPE_LEN + 8 * lane), last, mask);
    xxh_u64 accs[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        accs[i] = __shfl_sync(mask, acc, i, 8);
    if (lane == 0)
        blocks[2ull * n + g] = XXH3_mergeAccs(accs, secret + XXH_SECRET_MERGEACCS_START,
                                              (xxh_u64)len * XXH_PRIME64_1);
}
"""
#: What xxhash.h includes, for NVRTC (which has no C library): only what XXH3 needs.
_HEADERS = {
    b"stddef.h": b"#pragma once\ntypedef unsigned long size_t;\ntypedef long ptrdiff_t;\n"
                 b"#define NULL 0\n#define offsetof(t, m) ((size_t)&(((t *)0)->m))\n",
    b"stdint.h": b"#pragma once\ntypedef unsigned char uint8_t;\ntypedef unsigned short uint16_t;\n"
                 b"typedef unsigned int uint32_t;\ntypedef unsigned long long uint64_t;\n"
                 b"typedef signed char int8_t;\ntypedef short int16_t;\ntypedef int int32_t;\n"
                 b"typedef long long int64_t;\ntypedef unsigned long uintptr_t;\n",
    b"limits.h": b"#pragma once\n#define UINT_MAX 0xffffffffU\n"
                 b"#define ULONG_MAX 0xffffffffffffffffUL\n"
                 b"#define ULLONG_MAX 0xffffffffffffffffULL\n",
    b"stdlib.h": b"#pragma once\n",
    b"string.h": b"#pragma once\n#include <stddef.h>\n"
                 b"static inline int memcmp(const void *a, const void *b, size_t n) {\n"
                 b"  const unsigned char *p = (const unsigned char *)a;\n"
                 b"  const unsigned char *q = (const unsigned char *)b;\n"
                 b"  for (size_t i = 0; i < n; i++)\n"
                 b"    if (p[i] != q[i]) return p[i] < q[i] ? -1 : 1;\n"
                 b"  return 0;\n}\n",
    b"assert.h": b"#pragma once\n#define assert(x) ((void)0)\n",
}


def _check(result: object, what: str) -> Any:  # cuda.bindings' objects (no stubs)
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def blocks_of(addr: int, nbytes: int, block: int = GPU_SUM_BLOCK) -> list[tuple[int, int]]:
    """(address, bytes) of each checksum block of a range (one, empty, for an empty range)."""
    if nbytes == 0:
        return [(addr, 0)]
    return [(addr + at, min(block, nbytes - at)) for at in range(0, nbytes, block)]


class GpuHashes:
    """Digests of blocks in flight on a device: the block table (pinned host memory the kernel
    reads and writes in place) and the event behind the kernel. :meth:`digests` once the work
    on the stream is known to be over."""

    def __init__(self, host: torch.Tensor, event: object, n: int) -> None:
        self._host: torch.Tensor | None = host
        self.event, self._n = event, n

    def digests(self) -> list[int]:
        """The blocks' digests (the caller has waited for :attr:`event`)."""
        if self._host is None:
            raise RuntimeError("the block table is released")
        return [d & 0xFFFFFFFFFFFFFFFF for d in self._host[2 * self._n :].tolist()]

    def release(self) -> None:
        """Destroy the event and let the table go (the work is over, or never ran)."""
        cudart.cudaEventDestroy(self.event)
        self._host = None


class GpuSums:
    """The checksum kernel of each device and a stream per device it runs on. Owned by the
    engine's :class:`~.cuda_copy.CudaCopier`.

    The kernel is compiled (NVRTC, CPU only) on a thread of its own, once per GPU architecture,
    from :meth:`prime` or the first :meth:`ready`; :meth:`ready` then loads it on the calling
    thread, before that thread issues its copies: a module loaded while a copy of the same
    process is in flight waits for that copy (as long as the copy runs), and stalled the
    training thread's CUDA calls as long. ``arch_of``, ``build`` and ``load`` replace the
    device's architecture, the compiler and the loading of a cubin (tests)."""

    def __init__(self, arch_of: Callable[[int], str] | None = None,
                 build: Callable[[str], bytes] | None = None,
                 load: Callable[[int, bytes], object | None] | None = None) -> None:
        self._arch = arch_of or _arch
        self._build = build or compile_kernel
        self._load_kernel = load or self._load
        self._lock = threading.Lock()
        self._cubins: dict[str, bytes | None] = {}  # architecture -> cubin (None: none to be had)
        self._compiling: set[str] = set()
        self._kernels: dict[int, object] = {}  # device -> function (None: cannot be had)
        self._modules: list[object] = []
        self._streams: dict[int, object] = {}
        self._builders: list[threading.Thread] = []
        self._told = False

    def prime(self, device: int) -> None:
        """Start compiling the kernel for ``device``'s architecture (no CUDA call is made)."""
        self._compiled(self._arch(device))

    def ready(self, device: int) -> bool:
        """Whether the kernel can run on ``device``: loads it here once it is compiled (call
        before issuing copies on this thread); starts compiling it the first time."""
        with self._lock:
            if device in self._kernels:
                return self._kernels[device] is not None
        arch = self._arch(device)
        self._compiled(arch)
        with self._lock:  # looked up again: the build may have ended since
            if arch not in self._cubins:
                return False  # still compiling
            if device not in self._kernels:
                cubin = self._cubins[arch]
                self._kernels[device] = cubin and self._load_kernel(device, cubin)
            return self._kernels[device] is not None

    def _compiled(self, arch: str) -> None:
        """Start compiling the kernel for ``arch`` on a thread of its own, unless it is built
        or being built (:attr:`_cubins` has it once over: None where it cannot be had)."""
        with self._lock:
            if arch in self._cubins or arch in self._compiling:
                return
            self._compiling.add(arch)
            builder = threading.Thread(target=self._compile, args=(arch,), daemon=True,
                                       name="dcp_datastates-gpu-sums")
            self._builders.append(builder)
        builder.start()

    def _tell(self, why: str) -> None:
        if not self._told:
            self._told = True
            log.info("dcp_datastates: checksums computed on the CPU at the commit (%s)", why)

    def give_up(self, device: int, exc: BaseException) -> None:
        """The kernel failed on ``device``: not used there again (logged)."""
        with self._lock:
            self._kernels[device] = None
        log.warning("dcp_datastates: the GPU checksum kernel failed on device %d (%s); the "
                    "checksums of its copies are computed on the CPU at the commit", device, exc)

    def _compile(self, arch: str) -> None:
        try:
            cubin = self._build(arch)
        except Exception as exc:  # noqa: BLE001 - the CPU checksums stand in
            cubin = None
            with self._lock:
                self._tell(f"the GPU kernel could not be built: {exc}")
        with self._lock:
            self._cubins[arch] = cubin
            self._compiling.discard(arch)

    def _load(self, device: int, cubin: bytes) -> object | None:
        """The kernel loaded on ``device`` and its stream (None where that fails, logged);
        ``device`` is left current on the calling thread (making the one that was current
        before current again could make a context there: another rank's GPU)."""
        try:
            _check(cudart.cudaSetDevice(device), "cudaSetDevice")
            module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            self._modules.append(module)
            kernel = _check(driver.cuModuleGetFunction(module, b"dsh_xxh3_blocks"),
                            "cuModuleGetFunction")
            self._streams[device] = _check(
                cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
                "cudaStreamCreateWithFlags")
        except Exception as exc:  # noqa: BLE001 - the CPU checksums stand in
            self._tell(f"the GPU kernel could not be loaded on device {device}: {exc}")
            return None
        return kernel

    def launch(self, device: int, after: object, blocks: list[tuple[int, int]]) -> GpuHashes:
        """Hash ``blocks`` (address, bytes) of GPU memory on ``device`` once ``after`` (an
        event) is reached; the returned event is recorded behind the kernel. Call only where
        :meth:`ready` said True. The kernel reads its block table from pinned host memory and
        writes the digests there (no device memory: a block of torch's allocator would be
        shared with the training's stream, whose work is not ordered with this one)."""
        stream, kernel, n = self._streams[device], self._kernels[device], len(blocks)
        host = torch.empty(3 * n, dtype=torch.int64, pin_memory=True)
        host[: 2 * n] = torch.tensor([a for a, _ in blocks] + [b for _, b in blocks],
                                     dtype=torch.int64)
        # torch's pinned allocator may have made another device current on this thread (its
        # runtime's idea of the current device is not cuda.bindings'): the event is the device's
        _check(cudart.cudaSetDevice(device), "cudaSetDevice")
        # made before the launch: nothing that can fail is left between it and the record
        event = _check(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming),
                       "cudaEventCreateWithFlags")
        try:
            _check(cudart.cudaStreamWaitEvent(stream, after, 0), "cudaStreamWaitEvent")
            args = (ctypes.c_void_p(host.data_ptr()), ctypes.c_uint(n))
            pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
            _check(driver.cuLaunchKernel(kernel, -(-8 * n // _THREADS), 1, 1, _THREADS, 1, 1,
                                         0, stream, ctypes.addressof(pointers), 0),
                   "cuLaunchKernel")
            _check(cudart.cudaEventRecord(event, stream), "cudaEventRecord")
        except BaseException:  # the table must outlive a kernel launched (the caller goes on)
            cudart.cudaStreamSynchronize(stream)
            cudart.cudaEventDestroy(event)
            raise
        return GpuHashes(host, event, n)

    def close(self) -> None:
        """Wait for the compilers, then unload the kernels and destroy the streams (no hash
        may be in flight)."""
        for builder in self._builders:
            builder.join()
        with self._lock:
            modules, streams = self._modules, self._streams
            self._modules, self._streams, self._kernels = [], {}, {}
        for stream in streams.values():
            cudart.cudaStreamDestroy(stream)
        for module in modules:
            driver.cuModuleUnload(module)


def _arch(device: int) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def compile_kernel(arch: str) -> bytes:
    """The kernel compiled by NVRTC for ``arch`` (a cubin)."""
    if nvrtc is None or not HEADER.exists():
        raise RuntimeError(f"{HEADER.name} or cuda.bindings.nvrtc is missing")
    headers = {**_HEADERS, b"xxhash.h": HEADER.read_bytes()}
    program = _check(nvrtc.nvrtcCreateProgram(_KERNEL, b"dsh_xxh3.cu", len(headers),
                                              list(headers.values()), list(headers)),
                     "nvrtcCreateProgram")
    try:
        options = [b"--std=c++17", b"-default-device", f"--gpu-architecture={arch}".encode()]
        if int(nvrtc.nvrtcCompileProgram(program, len(options), options)[0]) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(program), "log size")
            text = b" " * size
            nvrtc.nvrtcGetProgramLog(program, text)
            raise RuntimeError(f"NVRTC: {text.decode(errors='replace')[:500]}")
        size = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return cubin
