/* dcp_uring: blocking batched pread/pwrite/fsync over io_uring. See dcp_uring.h. */
#define _GNU_SOURCE
#include "dcp_uring.h"

#include <errno.h>
#include <liburing.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

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
    int dense_only;      /* the kernel has no sparse buffer tables: re-register sets in full */
    dsu_slot *slots;     /* depth entries */
    unsigned *free_idx;  /* stack of free slot indices */
    struct iovec *tab;   /* the kernel's fixed-buffer table (cap entries, empty ones {NULL, 0}) */
    unsigned cap;        /* 0: no table registered */
    unsigned *used;      /* indices of the nreg non-empty entries of tab (cap entries) */
    unsigned nreg;
} dsu_ring;

/* Linux 6.12+ (include/uapi/linux/io_uring.h); Debian's liburing 2.3 has neither. 6.12 itself has
 * pad[6] where later kernels have src_off, dst_off, nr: all zero means "the whole table". */
#define DSU_REGISTER_CLONE_BUFFERS 30
struct dsu_clone_buffers {
    uint32_t src_fd;
    uint32_t flags;
    uint32_t src_off;
    uint32_t dst_off;
    uint32_t nr;
    uint32_t pad[3];
};

/* Smallest table we register: slots are cheap (a pointer each in the kernel), and growing the
 * table means registering, hence pinning, every buffer anew. */
#define DSU_MIN_TABLE 1024u
#define DSU_MAX_TABLE 16384u /* IORING_MAX_REG_BUFFERS */

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

static void forget_table(dsu_ring *r)
{
    free(r->tab);
    free(r->used);
    r->tab = NULL;
    r->used = NULL;
    r->cap = r->nreg = 0;
}

void dsu_destroy(void *ring)
{
    dsu_ring *r = ring;
    if (!r)
        return;
    io_uring_queue_exit(&r->ring); /* also drops buffer registrations */
    forget_table(r);
    free(r->slots);
    free(r->free_idx);
    free(r);
}

/* Recount the non-empty entries of the table. */
static void reindex(dsu_ring *r)
{
    r->nreg = 0;
    for (unsigned i = 0; i < r->cap; i++)
        if (r->tab[i].iov_len > 0)
            r->used[r->nreg++] = i;
}

/* Drop the whole table (and the pins no other ring shares). On failure the ring is broken. */
static int drop_table(dsu_ring *r)
{
    if (r->cap == 0)
        return 0;
    int ret;
    do
        ret = io_uring_unregister_buffers(&r->ring);
    while (ret == -EINTR || ret == -EAGAIN);
    if (ret < 0) {
        r->broken = 1; /* the old set is still pinned: only dsu_destroy drops it now */
        return ret;
    }
    forget_table(r);
    return 0;
}

/* Room for a table of cap entries, all empty (the kernel's table is not touched). */
static int alloc_table(dsu_ring *r, unsigned cap)
{
    r->tab = calloc(cap, sizeof(*r->tab));
    r->used = calloc(cap, sizeof(*r->used));
    if (!r->tab || !r->used) {
        forget_table(r);
        return -ENOMEM;
    }
    r->cap = cap;
    r->nreg = 0;
    return 0;
}

/* Put iov (or nothing: {NULL, 0}) into slot i of the kernel's table; pins iov's pages. */
static int set_slot(dsu_ring *r, unsigned i, const struct iovec *iov)
{
    int ret;
    do
        ret = io_uring_register_buffers_update_tag(&r->ring, i, iov, NULL, 1);
    while (ret == -EINTR || ret == -EAGAIN);
    if (ret < 0)
        return ret;
    if (ret != 1)
        return -EIO;
    r->tab[i] = *iov;
    return 0;
}

/* Turn the table into `want` (count > 0) slot by slot: held iovecs stay, the rest are cleared,
 * new ones go to empty slots. Returns 1 (nothing done) if the table is too small. */
static int apply_diff(dsu_ring *r, const struct iovec *want, size_t count)
{
    char *keep = calloc(r->cap, 1), *have = calloc(count, 1);
    int ret = -ENOMEM;
    if (!keep || !have)
        goto out;
    size_t kept = 0;
    for (size_t i = 0; i < count; i++) {
        for (unsigned k = 0; k < r->nreg; k++) {
            unsigned s = r->used[k];
            if (!keep[s] && r->tab[s].iov_base == want[i].iov_base &&
                r->tab[s].iov_len == want[i].iov_len) {
                keep[s] = have[i] = 1;
                kept++;
                break;
            }
        }
    }
    ret = 1;
    if (count > r->cap) /* count - kept new ones, r->cap - kept empty slots once cleared */
        goto out;
    static const struct iovec empty = {NULL, 0};
    ret = 0;
    for (unsigned k = 0; k < r->nreg && ret == 0; k++)
        if (!keep[r->used[k]])
            ret = set_slot(r, r->used[k], &empty);
    if (ret < 0) { /* a slot we meant to clear may still hold a buffer not in `want` */
        int dropped = drop_table(r);
        ret = dropped < 0 ? dropped : ret;
        goto out;
    }
    unsigned s = 0;
    for (size_t i = 0; i < count && ret == 0; i++) {
        if (have[i])
            continue;
        while (r->tab[s].iov_len > 0)
            s++; /* there is room: counted above */
        ret = set_slot(r, s, &want[i]);
    }
out:
    if (r->cap > 0)
        reindex(r);
    free(keep);
    free(have);
    return ret;
}

/* Register a new table holding `want` (count > 0, no table registered). */
static int new_table(dsu_ring *r, struct iovec *want, size_t count)
{
    if (count > DSU_MAX_TABLE)
        return -EINVAL;
    if (!r->dense_only) {
        unsigned cap = count > DSU_MIN_TABLE / 2 ? (unsigned)count * 2 : DSU_MIN_TABLE;
        if (cap > DSU_MAX_TABLE)
            cap = DSU_MAX_TABLE;
        int ret = alloc_table(r, cap);
        if (ret < 0)
            return ret;
        do
            ret = io_uring_register_buffers_sparse(&r->ring, cap);
        while (ret == -EINTR || ret == -EAGAIN);
        if (ret == 0) {
            for (size_t i = 0; i < count && ret == 0; i++)
                ret = set_slot(r, (unsigned)i, &want[i]);
            reindex(r);
            return ret; /* on failure the table holds a part of `want` */
        }
        forget_table(r);
        if (ret != -EINVAL)
            return ret;
        r->dense_only = 1; /* before Linux 5.19 */
    }
    int ret = alloc_table(r, (unsigned)count);
    if (ret < 0)
        return ret;
    do
        ret = io_uring_register_buffers(&r->ring, want, (unsigned)count);
    while (ret == -EINTR || ret == -EAGAIN);
    if (ret < 0) {
        forget_table(r);
        return ret;
    }
    memcpy(r->tab, want, count * sizeof(*want));
    reindex(r);
    return 0;
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
    struct iovec *want = NULL;
    if (count > 0 && !(want = calloc(count, sizeof(*want))))
        return -ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        for (uint64_t off = 0; off < bufs[i].nbytes; off += DSU_MAX_PIECE) {
            uint64_t left = bufs[i].nbytes - off;
            want[k].iov_base = (void *)(uintptr_t)(bufs[i].addr + off);
            want[k++].iov_len = left < DSU_MAX_PIECE ? left : DSU_MAX_PIECE;
        }
    }
    int ret = 1;
    if (r->cap > 0 && !r->dense_only && count > 0)
        ret = apply_diff(r, want, count);
    if (ret > 0) { /* no table, an empty set, too small a table, or an old kernel */
        ret = drop_table(r);
        if (ret == 0 && count > 0)
            ret = new_table(r, want, count);
    }
    free(want);
    return ret;
}

int dsu_share_buffers(void *dst, void *src)
{
    dsu_ring *d = dst, *s = src;
    if (!d || !s || d == s)
        return -EINVAL;
    if (d->broken || s->broken)
        return -EBADFD;
    int ret = drop_table(d);
    if (ret < 0 || s->nreg == 0)
        return ret;
    ret = alloc_table(d, s->cap);
    if (ret < 0)
        return ret;
    struct dsu_clone_buffers arg;
    memset(&arg, 0, sizeof(arg));
    arg.src_fd = (uint32_t)s->ring.ring_fd;
    do
        ret = (int)syscall(__NR_io_uring_register, d->ring.ring_fd, DSU_REGISTER_CLONE_BUFFERS,
                           &arg, 1);
    while (ret < 0 && errno == EINTR);
    if (ret < 0) {
        ret = -errno;
        forget_table(d);
        return ret;
    }
    memcpy(d->tab, s->tab, s->cap * sizeof(*s->tab));
    d->dense_only = s->dense_only;
    reindex(d);
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
    for (unsigned k = 0; k < r->nreg; k++) {
        unsigned i = r->used[k];
        uint64_t base = (uint64_t)(uintptr_t)r->tab[i].iov_base;
        if (addr >= base && addr - base < r->tab[i].iov_len) {
            *room = base + r->tab[i].iov_len - addr;
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
