/* dcp_uring: a minimal blocking shim over liburing for dcp_datastates (called through ctypes).
 *
 * Every function blocks until its work is done. A ring handle must not be used by two threads
 * at once; the Python side keeps one ring per concurrent caller. All functions return 0 (or a
 * count) on success and -errno on failure. A ring whose state a failure left unknown is marked
 * broken: every later call on it returns -EBADFD, and only dsu_destroy is left to do.
 */
#ifndef DCP_URING_H
#define DCP_URING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DSU_API __attribute__((visibility("default")))

/* Bumped on every change of this interface; dcp_datastates refuses a shim of another version. */
#define DSU_ABI_VERSION 3

/* Returned by dsu_rw when a read meets end of file before the request is complete.
 * It is outside the errno range (errno values are < 4096), so it cannot be confused with one. */
#define DSU_EOF (-65536)

/* Largest buffer the kernel accepts per registered iovec, and the largest single I/O we issue. */
#define DSU_MAX_PIECE ((size_t)1 << 30)

/* One contiguous transfer: nbytes at memory address addr <-> file offset offset. */
typedef struct {
    uint64_t addr;
    uint64_t nbytes;
    uint64_t offset;
} dsu_req;

/* One buffer to register: [addr, addr + nbytes). */
typedef struct {
    uint64_t addr;
    uint64_t nbytes;
} dsu_buf;

/* DSU_ABI_VERSION of the built shim. */
DSU_API int dsu_abi_version(void);

/* Create a ring with `depth` submission entries (the maximum number of I/Os in flight). */
DSU_API int dsu_create(unsigned depth, void **ring_out);

/* Tear the ring down (releases its buffer registrations). NULL is accepted. */
DSU_API void dsu_destroy(void *ring);

/* Make `bufs` (n entries, each split into <= 1 GiB iovecs) the ring's whole fixed-buffer set;
 * n == 0 empties it. Only call it while the ring is idle. Where the kernel has sparse tables
 * (5.19+) only the difference is applied: an iovec already held keeps its slot and its pin, only
 * new iovecs are pinned (and accounted), dropped ones are released; older kernels get the whole
 * set registered anew. Returns 0 or -errno; on failure the ring holds some of `bufs` or none
 * (call again with the set you want; dsu_rw uses plain READ/WRITE for what is not held), or,
 * where a registration could not be dropped, the ring is broken. */
DSU_API int dsu_set_buffers(void *ring, const dsu_buf *bufs, size_t n);

/* Make `dst`'s fixed-buffer set the one `src` holds, sharing its pinned pages: nothing is pinned
 * or charged to RLIMIT_MEMLOCK again (IORING_REGISTER_CLONE_BUFFERS, Linux 6.12+). Both rings
 * must belong to this process and be idle. The pages stay pinned until every ring holding them
 * dropped them. Returns 0 or -errno (EINVAL where the kernel cannot clone); on failure `dst`
 * holds no fixed buffers (or is broken, as for dsu_set_buffers). */
DSU_API int dsu_share_buffers(void *dst, void *src);

/* Number of fixed-buffer iovecs the ring holds (its own or shared), or -EBADFD once it is
 * broken (a failure left its state unknown: destroy it). */
DSU_API int dsu_registered(void *ring);

/* Perform every request (write != 0: memory -> file, else file -> memory). Requests are split
 * into pieces of at most max_io bytes (0: DSU_MAX_PIECE), at most `depth` pieces are in flight,
 * pieces inside a registered buffer use READ_FIXED/WRITE_FIXED, short transfers are resubmitted.
 * Zero-length requests are ignored. Returns 0, DSU_EOF, or -errno of the first failure; on
 * failure no new pieces are issued. It never returns while a piece it submitted is in flight:
 * where waiting for completions fails, the ring is marked broken and polled until all are in. */
DSU_API int64_t dsu_rw(void *ring, int write, int fd, const dsu_req *reqs, size_t n,
                       size_t max_io);

/* fsync(fd) through IORING_OP_FSYNC; like dsu_rw, it returns only once the fsync completed. */
DSU_API int dsu_fsync(void *ring, int fd);

#ifdef __cplusplus
}
#endif

#endif
