/* dcp_uring: blocking batched pread/pwrite/fsync over io_uring. See dcp_uring.h. */
#define _GNU_SOURCE
#include "dcp_uring.h"

#include <errno.h>
#include <liburing.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/uio.h>
#include <time.h>

/* One piece in flight. */
typedef struct {
    uint64_t addr, left, off;
    int buf;        /* fixed-buffer index, or -1 */
    int was_short;  /* a previous transfer of this piece came back short */
} dsu_slot;

typedef struct {
    struct io_uring ring;
    unsigned depth;
    int broken;          /* submit, wait or unregister failed hard: refuse further use */
    dsu_slot *slots;     /* depth entries */
    unsigned *free_idx;  /* stack of free slot indices */
    struct iovec *iov;   /* registered fixed buffers (nreg entries) */
    unsigned nreg;
} dsu_ring;

int dsu_abi_version(void)
{
    return DSU_ABI_VERSION;
}

int dsu_create(unsigned depth, void **ring_out)
{
    if (!ring_out || depth == 0 || depth > 32768)
        return -EINVAL;
    *ring_out = NULL;
    dsu_ring *r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->slots = calloc(depth, sizeof(*r->slots));
    r->free_idx = calloc(depth, sizeof(*r->free_idx));
    if (!r->slots || !r->free_idx) {
        free(r->slots);
        free(r->free_idx);
        free(r);
        return -ENOMEM;
    }
    int ret = io_uring_queue_init(depth, &r->ring, 0);
    if (ret < 0) {
        free(r->slots);
        free(r->free_idx);
        free(r);
        return ret;
    }
    r->depth = depth;
    *ring_out = r;
    return 0;
}

void dsu_destroy(void *ring)
{
    dsu_ring *r = ring;
    if (!r)
        return;
    io_uring_queue_exit(&r->ring); /* also drops buffer registrations */
    free(r->iov);
    free(r->slots);
    free(r->free_idx);
    free(r);
}

int dsu_set_buffers(void *ring, const dsu_buf *bufs, size_t n)
{
    dsu_ring *r = ring;
    if (!r || (n > 0 && !bufs))
        return -EINVAL;
    if (r->broken)
        return -EBADFD;
    size_t count = 0;
    for (size_t i = 0; i < n; i++) {
        if (bufs[i].addr == 0 || bufs[i].nbytes == 0)
            return -EINVAL;
        count += (bufs[i].nbytes + DSU_MAX_PIECE - 1) / DSU_MAX_PIECE;
        if (count > 65536) /* the kernel allows 16384 */
            return -EINVAL;
    }
    struct iovec *iov = NULL;
    if (count > 0 && !(iov = calloc(count, sizeof(*iov))))
        return -ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        for (uint64_t off = 0; off < bufs[i].nbytes; off += DSU_MAX_PIECE) {
            uint64_t left = bufs[i].nbytes - off;
            iov[k].iov_base = (void *)(uintptr_t)(bufs[i].addr + off);
            iov[k++].iov_len = left < DSU_MAX_PIECE ? left : DSU_MAX_PIECE;
        }
    }
    if (r->nreg > 0) {
        int ret;
        do
            ret = io_uring_unregister_buffers(&r->ring);
        while (ret == -EINTR || ret == -EAGAIN);
        if (ret < 0) {
            r->broken = 1; /* the old set is still pinned: only dsu_destroy drops it now */
            free(iov);
            return ret;
        }
    }
    free(r->iov);
    r->iov = NULL;
    r->nreg = 0;
    if (count == 0)
        return 0;
    int ret = io_uring_register_buffers(&r->ring, iov, (unsigned)count);
    if (ret < 0) {
        free(iov);
        return ret;
    }
    r->iov = iov;
    r->nreg = (unsigned)count;
    return 0;
}

int dsu_registered(void *ring)
{
    dsu_ring *r = ring;
    if (!r)
        return -EINVAL;
    return r->broken ? -EBADFD : (int)r->nreg;
}

/* Fixed-buffer index holding addr (and how many bytes of it from addr), or -1. */
static int find_fixed(const dsu_ring *r, uint64_t addr, uint64_t *room)
{
    for (unsigned i = 0; i < r->nreg; i++) {
        uint64_t base = (uint64_t)(uintptr_t)r->iov[i].iov_base;
        if (addr >= base && addr - base < r->iov[i].iov_len) {
            *room = base + r->iov[i].iov_len - addr;
            return (int)i;
        }
    }
    return -1;
}

/* The next completion. Once the ring is broken (also when waiting itself fails: then *err gets
 * the reason) it is polled with short naps instead, because callers must not return while
 * anything they submitted is in flight. */
static struct io_uring_cqe *next_cqe(dsu_ring *r, int64_t *err)
{
    static const struct timespec nap = {0, 100 * 1000};
    for (;;) {
        struct io_uring_cqe *cqe = NULL;
        int ret = r->broken ? io_uring_peek_cqe(&r->ring, &cqe)
                            : io_uring_wait_cqe(&r->ring, &cqe);
        if (ret == 0 && cqe)
            return cqe;
        if (!r->broken && (ret == -EINTR || ret == -EAGAIN))
            continue;
        if (!r->broken) {
            r->broken = 1;
            if (!*err)
                *err = ret < 0 ? ret : -EIO;
        }
        nanosleep(&nap, NULL);
    }
}

static void prep_slot(dsu_ring *r, struct io_uring_sqe *sqe, int write, int fd, unsigned idx)
{
    const dsu_slot *s = &r->slots[idx];
    void *p = (void *)(uintptr_t)s->addr;
    unsigned n = (unsigned)s->left;
    if (s->buf >= 0 && write)
        io_uring_prep_write_fixed(sqe, fd, p, n, s->off, s->buf);
    else if (s->buf >= 0)
        io_uring_prep_read_fixed(sqe, fd, p, n, s->off, s->buf);
    else if (write)
        io_uring_prep_write(sqe, fd, p, n, s->off);
    else
        io_uring_prep_read(sqe, fd, p, n, s->off);
    io_uring_sqe_set_data64(sqe, idx);
}

int64_t dsu_rw(void *ring, int write, int fd, const dsu_req *reqs, size_t n, size_t max_io)
{
    dsu_ring *r = ring;
    if (!r || (n > 0 && !reqs))
        return -EINVAL;
    if (r->broken)
        return -EBADFD;
    if (max_io == 0 || max_io > DSU_MAX_PIECE)
        max_io = DSU_MAX_PIECE;

    unsigned nfree = r->depth, inflight = 0; /* inflight: prepared, not yet completed */
    for (unsigned i = 0; i < r->depth; i++)
        r->free_idx[i] = i;
    size_t ri = 0;   /* cursor: request index ... */
    uint64_t pos = 0; /* ... and bytes of it already handed out */
    int64_t err = 0;

    for (;;) {
        /* Hand out new pieces while there is room and nothing failed. */
        while (!err && nfree > 0) {
            while (ri < n && pos >= reqs[ri].nbytes) {
                ri++;
                pos = 0;
            }
            if (ri == n)
                break;
            struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
            if (!sqe)
                break; /* cannot happen: SQ has >= depth entries */
            unsigned idx = r->free_idx[--nfree];
            dsu_slot *s = &r->slots[idx];
            uint64_t len = reqs[ri].nbytes - pos, room = 0;
            if (len > max_io)
                len = max_io;
            s->addr = reqs[ri].addr + pos;
            s->off = reqs[ri].offset + pos;
            s->buf = find_fixed(r, s->addr, &room);
            if (s->buf >= 0 && len > room)
                len = room; /* stop at the end of the registered iovec */
            s->left = len;
            s->was_short = 0;
            pos += len;
            prep_slot(r, sqe, write, fd, idx);
            inflight++;
        }
        if (inflight == 0)
            break;

        unsigned pending = r->broken ? 0 : io_uring_sq_ready(&r->ring);
        if (pending > 0) {
            int ret = io_uring_submit(&r->ring);
            if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
                /* Unsubmitted entries will never complete: forget them, reap the rest. */
                r->broken = 1;
                inflight -= io_uring_sq_ready(&r->ring);
                if (!err)
                    err = ret;
            }
            pending = r->broken ? 0 : io_uring_sq_ready(&r->ring);
        }
        if (inflight == pending) {
            if (inflight == 0)
                break;
            sched_yield(); /* transient submit failure with nothing in the kernel: retry */
            continue;
        }

        next_cqe(r, &err); /* wait for one; the loop below takes every completion that is in */
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&r->ring, head, cqe) {
            seen++;
            unsigned idx = (unsigned)io_uring_cqe_get_data64(cqe);
            dsu_slot *s = &r->slots[idx];
            int res = cqe->res;
            int again = 0;
            if (res < 0) {
                if ((res == -EINTR || res == -EAGAIN) && !err)
                    again = 1;
                else if (!err)
                    /* O_DIRECT: some filesystems fail the unaligned rest of a short read with EINVAL */
                    err = (!write && s->was_short && res == -EINVAL) ? DSU_EOF : res;
            } else if (res == 0) {
                if (!err)
                    err = write ? -EIO : DSU_EOF;
            } else {
                s->addr += (uint64_t)res;
                s->off += (uint64_t)res;
                s->left -= (uint64_t)res;
                if (s->left > 0) {
                    s->was_short = 1;
                    again = !err;
                }
            }
            if (again && !r->broken) {
                /* The completed entry freed an SQ slot, so this cannot fail. */
                struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
                if (sqe) {
                    prep_slot(r, sqe, write, fd, idx);
                    continue;
                }
                if (!err)
                    err = -EBUSY;
            } else if (again && !err) {
                err = -EBADFD;
            }
            inflight--;
            r->free_idx[nfree++] = idx;
        }
        io_uring_cq_advance(&r->ring, seen);
    }
    return err;
}

int dsu_fsync(void *ring, int fd)
{
    dsu_ring *r = ring;
    if (!r)
        return -EINVAL;
    if (r->broken)
        return -EBADFD;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
    if (!sqe)
        return -EBUSY;
    io_uring_prep_fsync(sqe, fd, 0);
    io_uring_sqe_set_data64(sqe, 0);
    int ret;
    do
        ret = io_uring_submit(&r->ring);
    while (ret == -EINTR || ret == -EAGAIN);
    if (ret < 0) { /* nothing was submitted */
        r->broken = 1;
        return ret;
    }
    int64_t err = 0;
    struct io_uring_cqe *cqe = next_cqe(r, &err);
    ret = cqe->res;
    io_uring_cqe_seen(&r->ring, cqe);
    if (err)
        return (int)err;
    return ret < 0 ? ret : 0;
}
