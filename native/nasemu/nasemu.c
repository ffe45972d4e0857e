/*
 * nasemu: a FUSE passthrough that behaves like a mid-range NAS seen from one client.
 *
 *   nasemu BACKING MOUNTPOINT [--meta-latency-us N] [--meta-ops-per-sec N] [--meta-burst N]
 *          [--bandwidth-mbps N] [--threads N] [--direct-io] [--stats-file PATH] [fuse args]
 *
 * It charges, per metadata operation (create, mknod, mkdir, symlink, link, rename, unlink, rmdir,
 * fsync, fsyncdir, setattr = chmod/chown/truncate/utimens, open), a queueing delay from one token
 * bucket shared by every client (--meta-ops-per-sec, the metadata server's capacity) followed by a
 * round-trip latency (--meta-latency-us). Data (read + write bytes) passes a second shared bucket
 * (--bandwidth-mbps, in MB/s = 10^6 bytes/s). 0 disables a limit. Lookups, getattr and readdir
 * are free, as an NFS client's attribute cache would mostly make them.
 *
 * Every operation is counted. Reading the hidden file MOUNTPOINT/.nasemu-stats returns the counters
 * as JSON (a snapshot taken at open; the file is not listed by readdir and not counted); they are
 * also written to --stats-file at unmount. Benchmarks diff two snapshots.
 *
 * Built by bench/nasemu.py with: cc -O2 nasemu.c $(pkg-config --cflags --libs fuse3)
 */
#define FUSE_USE_VERSION 312
#define _GNU_SOURCE

#include <fuse.h>
#include <fuse_opt.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define STATS_NAME "/.nasemu-stats"

/* ---------------------------------------------------------------- options */

struct options {
	unsigned int meta_latency_us;
	unsigned int meta_ops_per_sec;
	unsigned int meta_burst;
	unsigned int bandwidth_mbps;
	unsigned int threads;
	int direct_io;        /* every open file bypasses the client page cache */
	int direct_io_writes; /* only files opened for writing do (reads keep readahead) */
	char *stats_file;
	int show_help;
};

static struct options opt = {
	.meta_latency_us = 1000,
	.meta_ops_per_sec = 3000,
	.meta_burst = 32,
	.bandwidth_mbps = 2000,
	.threads = 64,
};

static char *backing;          /* absolute path of the backing directory */
static int root_fd = -1;       /* kept open: fuse_main chdirs to / when daemonizing */
static struct timespec t_start;

#define OPT(t, p) { t, offsetof(struct options, p), 1 }
static const struct fuse_opt option_spec[] = {
	OPT("--meta-latency-us=%u", meta_latency_us),
	OPT("--meta-latency-us %u", meta_latency_us),
	OPT("--meta-ops-per-sec=%u", meta_ops_per_sec),
	OPT("--meta-ops-per-sec %u", meta_ops_per_sec),
	OPT("--meta-burst=%u", meta_burst),
	OPT("--meta-burst %u", meta_burst),
	OPT("--bandwidth-mbps=%u", bandwidth_mbps),
	OPT("--bandwidth-mbps %u", bandwidth_mbps),
	OPT("--threads=%u", threads),
	OPT("--threads %u", threads),
	OPT("--stats-file=%s", stats_file),
	OPT("--stats-file %s", stats_file),
	OPT("--direct-io", direct_io),
	OPT("--direct-io-writes", direct_io_writes),
	OPT("--help", show_help),
	OPT("-h", show_help),
	FUSE_OPT_END
};

/* ---------------------------------------------------------------- counters */

enum op {
	OP_LOOKUP_GETATTR, OP_READLINK, OP_MKNOD, OP_MKDIR, OP_UNLINK, OP_RMDIR, OP_SYMLINK,
	OP_RENAME, OP_LINK, OP_CHMOD, OP_CHOWN, OP_TRUNCATE, OP_UTIMENS, OP_OPEN, OP_CREATE,
	OP_READ, OP_WRITE, OP_STATFS, OP_FLUSH, OP_RELEASE, OP_FSYNC, OP_OPENDIR, OP_READDIR,
	OP_RELEASEDIR, OP_FSYNCDIR, OP_ACCESS, OP_FALLOCATE, OP__COUNT
};

static const char *op_names[OP__COUNT] = {
	"getattr", "readlink", "mknod", "mkdir", "unlink", "rmdir", "symlink",
	"rename", "link", "chmod", "chown", "truncate", "utimens", "open", "create",
	"read", "write", "statfs", "flush", "release", "fsync", "opendir", "readdir",
	"releasedir", "fsyncdir", "access", "fallocate",
};

static uint64_t op_count[OP__COUNT];
static uint64_t meta_ops;        /* operations charged as metadata */
static uint64_t meta_wait_ns;    /* time spent queueing on the metadata bucket */
static uint64_t meta_latency_ns; /* time spent in the round-trip latency */
static uint64_t bw_wait_ns;      /* time spent queueing on the bandwidth bucket */
static uint64_t bytes_read, bytes_written;
static uint64_t pause_wait_ns;   /* time writes spent held by SIGUSR1 (pause) */
static volatile sig_atomic_t paused;

#define INC(var, n) __atomic_fetch_add(&(var), (n), __ATOMIC_RELAXED)
#define GET(var) __atomic_load_n(&(var), __ATOMIC_RELAXED)

/* ---------------------------------------------------------------- time and buckets */

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t deadline)
{
	struct timespec ts = { .tv_sec = deadline / 1000000000ull,
			       .tv_nsec = deadline % 1000000000ull };
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

/*
 * A token bucket written as GCRA with reservations: each caller books the next slot under the
 * lock and sleeps outside it, so waiting clients queue in arrival order and the long-run rate is
 * exactly the configured one; `burst_ns` worth of slots may be taken at once.
 */
struct bucket {
	pthread_mutex_t lock;
	uint64_t tat; /* theoretical arrival time of the next unit */
};

static struct bucket meta_bucket = { PTHREAD_MUTEX_INITIALIZER, 0 };
static struct bucket bw_bucket = { PTHREAD_MUTEX_INITIALIZER, 0 };

/* Returns ns waited. cost_ns = time the units occupy the resource. */
static uint64_t bucket_take(struct bucket *b, uint64_t cost_ns, uint64_t burst_ns)
{
	uint64_t now = now_ns(), start;
	pthread_mutex_lock(&b->lock);
	if (b->tat < now)
		b->tat = now;
	start = b->tat;
	b->tat += cost_ns;
	pthread_mutex_unlock(&b->lock);
	if (start > now + burst_ns) {
		sleep_until(start - burst_ns);
		return start - burst_ns - now;
	}
	return 0;
}

static void charge_meta(void)
{
	INC(meta_ops, 1);
	if (opt.meta_ops_per_sec) {
		uint64_t interval = 1000000000ull / opt.meta_ops_per_sec;
		uint64_t w = bucket_take(&meta_bucket, interval, interval * opt.meta_burst);
		if (w)
			INC(meta_wait_ns, w);
	}
	if (opt.meta_latency_us) {
		uint64_t t0 = now_ns();
		sleep_until(t0 + (uint64_t)opt.meta_latency_us * 1000ull);
		INC(meta_latency_ns, now_ns() - t0);
	}
}

/* SIGUSR1 holds every data write until SIGUSR2: lets a benchmark build a drain backlog. */
static void on_pause(int sig)
{
	paused = (sig == SIGUSR1);
}

/* SIGRTMIN makes every fsync and fsyncdir fail with EIO until SIGRTMIN+1: a disk whose
 * writeback failed, for tests of what a client does after a failed fsync. */
static volatile sig_atomic_t fail_fsyncs;

static void on_fsync_fault(int sig)
{
	fail_fsyncs = (sig == SIGRTMIN);
}

static void hold_if_paused(void)
{
	if (!paused)
		return;
	uint64_t t0 = now_ns();
	while (paused)
		sleep_until(now_ns() + 1000000ull);
	INC(pause_wait_ns, now_ns() - t0);
}

static void charge_bytes(size_t n)
{
	if (opt.bandwidth_mbps && n) {
		/* bandwidth_mbps MB/s = bandwidth_mbps bytes per us */
		uint64_t cost = (uint64_t)n * 1000ull / opt.bandwidth_mbps;
		/* 16 MiB of burst: 8 clients with 1 MiB requests and a few more in flight pass
		 * unhindered while the long-run rate stays exactly the cap */
		uint64_t burst = 16ull * 1024 * 1024 * 1000ull / opt.bandwidth_mbps;
		uint64_t w = bucket_take(&bw_bucket, cost, burst);
		if (w)
			INC(bw_wait_ns, w);
	}
}

/* ---------------------------------------------------------------- stats file */

static size_t stats_json(char *buf, size_t cap)
{
	size_t n = 0;
	uint64_t up = now_ns() - ((uint64_t)t_start.tv_sec * 1000000000ull + t_start.tv_nsec);
#define OUT(...) do { int r = snprintf(buf + n, cap > n ? cap - n : 0, __VA_ARGS__); \
			  if (r > 0) n += (size_t)r; } while (0)
	OUT("{\n  \"backing\": \"%s\",\n  \"uptime_s\": %.6f,\n", backing, up / 1e9);
	OUT("  \"config\": {\"meta_latency_us\": %u, \"meta_ops_per_sec\": %u, \"meta_burst\": %u, "
	    "\"bandwidth_mbps\": %u, \"threads\": %u, \"direct_io\": %d, "
	    "\"direct_io_writes\": %d},\n",
	    opt.meta_latency_us, opt.meta_ops_per_sec, opt.meta_burst, opt.bandwidth_mbps,
	    opt.threads, opt.direct_io, opt.direct_io_writes);
	OUT("  \"meta_ops\": %llu,\n", (unsigned long long)GET(meta_ops));
	OUT("  \"meta_wait_s\": %.6f,\n", GET(meta_wait_ns) / 1e9);
	OUT("  \"meta_latency_s\": %.6f,\n", GET(meta_latency_ns) / 1e9);
	OUT("  \"bw_wait_s\": %.6f,\n", GET(bw_wait_ns) / 1e9);
	OUT("  \"paused\": %d,\n  \"pause_wait_s\": %.6f,\n", (int)paused, GET(pause_wait_ns) / 1e9);
	OUT("  \"bytes_read\": %llu,\n", (unsigned long long)GET(bytes_read));
	OUT("  \"bytes_written\": %llu,\n", (unsigned long long)GET(bytes_written));
	OUT("  \"ops\": {");
	for (int i = 0; i < OP__COUNT; i++)
		OUT("%s\"%s\": %llu", i ? ", " : "", op_names[i], (unsigned long long)GET(op_count[i]));
	OUT("}\n}\n");
#undef OUT
	return n < cap ? n : cap;
}

/* ---------------------------------------------------------------- helpers */

/* One handle per open file; the stats file carries its snapshot instead of an fd. */
struct handle {
	int fd;
	char *snap;
	size_t snap_len;
};

#define H(fi) ((struct handle *)(uintptr_t)(fi)->fh)

static const char *rel(const char *path)
{
	return (path[0] == '/' && path[1] == '\0') ? "." : path + 1;
}

static int is_stats(const char *path)
{
	return path && strcmp(path, STATS_NAME) == 0;
}

static int new_handle(struct fuse_file_info *fi, int fd)
{
	struct handle *h = calloc(1, sizeof(*h));
	if (!h) {
		close(fd);
		return -ENOMEM;
	}
	h->fd = fd;
	fi->fh = (uintptr_t)h;
	if (opt.direct_io || (opt.direct_io_writes && (fi->flags & O_ACCMODE) != O_RDONLY))
		fi->direct_io = 1;
	return 0;
}

/* ---------------------------------------------------------------- operations */

static void *emu_init(struct fuse_conn_info *conn, struct fuse_config *cfg)
{
	(void)conn;
	cfg->use_ino = 1;
	/* ops on open files get no path: needed for unlinked-while-open files with hard_remove */
	cfg->nullpath_ok = 1;
	cfg->hard_remove = 1;
	cfg->entry_timeout = 1.0;
	cfg->attr_timeout = 1.0;
	cfg->negative_timeout = 0;
	return NULL;
}

static void emu_destroy(void *private_data)
{
	(void)private_data;
	if (opt.stats_file) {
		char buf[8192];
		size_t n = stats_json(buf, sizeof(buf));
		FILE *f = fopen(opt.stats_file, "w");
		if (f) {
			fwrite(buf, 1, n, f);
			fclose(f);
		}
	}
}

static int emu_getattr(const char *path, struct stat *st, struct fuse_file_info *fi)
{
	if (fi && H(fi)->snap) {
		memset(st, 0, sizeof(*st));
		st->st_mode = S_IFREG | 0444;
		st->st_nlink = 1;
		st->st_size = (off_t)H(fi)->snap_len;
		return 0;
	}
	if (is_stats(path)) {
		memset(st, 0, sizeof(*st));
		st->st_mode = S_IFREG | 0444;
		st->st_nlink = 1;
		st->st_ino = 1ull << 62;
		st->st_size = 1 << 20; /* an upper bound; reads are direct_io and stop short */
		return 0;
	}
	INC(op_count[OP_LOOKUP_GETATTR], 1);
	int r = fi ? fstat(H(fi)->fd, st) : fstatat(root_fd, rel(path), st, AT_SYMLINK_NOFOLLOW);
	return r == -1 ? -errno : 0;
}

static int emu_access(const char *path, int mask)
{
	if (is_stats(path))
		return 0;
	INC(op_count[OP_ACCESS], 1);
	return faccessat(root_fd, rel(path), mask, 0) == -1 ? -errno : 0;
}

static int emu_readlink(const char *path, char *buf, size_t size)
{
	INC(op_count[OP_READLINK], 1);
	ssize_t n = readlinkat(root_fd, rel(path), buf, size - 1);
	if (n == -1)
		return -errno;
	buf[n] = '\0';
	return 0;
}

static int emu_mknod(const char *path, mode_t mode, dev_t rdev)
{
	INC(op_count[OP_MKNOD], 1);
	charge_meta();
	return mknodat(root_fd, rel(path), mode, rdev) == -1 ? -errno : 0;
}

static int emu_mkdir(const char *path, mode_t mode)
{
	INC(op_count[OP_MKDIR], 1);
	charge_meta();
	return mkdirat(root_fd, rel(path), mode) == -1 ? -errno : 0;
}

static int emu_unlink(const char *path)
{
	INC(op_count[OP_UNLINK], 1);
	if (is_stats(path))
		return -EPERM;
	charge_meta();
	return unlinkat(root_fd, rel(path), 0) == -1 ? -errno : 0;
}

static int emu_rmdir(const char *path)
{
	INC(op_count[OP_RMDIR], 1);
	charge_meta();
	return unlinkat(root_fd, rel(path), AT_REMOVEDIR) == -1 ? -errno : 0;
}

static int emu_symlink(const char *target, const char *path)
{
	INC(op_count[OP_SYMLINK], 1);
	charge_meta();
	return symlinkat(target, root_fd, rel(path)) == -1 ? -errno : 0;
}

static int emu_rename(const char *from, const char *to, unsigned int flags)
{
	INC(op_count[OP_RENAME], 1);
	if (is_stats(from) || is_stats(to))
		return -EPERM;
	charge_meta();
	return renameat2(root_fd, rel(from), root_fd, rel(to), flags) == -1 ? -errno : 0;
}

static int emu_link(const char *from, const char *to)
{
	INC(op_count[OP_LINK], 1);
	charge_meta();
	return linkat(root_fd, rel(from), root_fd, rel(to), 0) == -1 ? -errno : 0;
}

static int emu_chmod(const char *path, mode_t mode, struct fuse_file_info *fi)
{
	INC(op_count[OP_CHMOD], 1);
	charge_meta();
	int r = fi ? fchmod(H(fi)->fd, mode) : fchmodat(root_fd, rel(path), mode, 0);
	return r == -1 ? -errno : 0;
}

static int emu_chown(const char *path, uid_t uid, gid_t gid, struct fuse_file_info *fi)
{
	INC(op_count[OP_CHOWN], 1);
	charge_meta();
	int r = fi ? fchown(H(fi)->fd, uid, gid)
		   : fchownat(root_fd, rel(path), uid, gid, AT_SYMLINK_NOFOLLOW);
	return r == -1 ? -errno : 0;
}

static int emu_truncate(const char *path, off_t size, struct fuse_file_info *fi)
{
	INC(op_count[OP_TRUNCATE], 1);
	charge_meta();
	if (fi)
		return ftruncate(H(fi)->fd, size) == -1 ? -errno : 0;
	int fd = openat(root_fd, rel(path), O_WRONLY | O_CLOEXEC);
	if (fd == -1)
		return -errno;
	int r = ftruncate(fd, size) == -1 ? -errno : 0;
	close(fd);
	return r;
}

static int emu_utimens(const char *path, const struct timespec tv[2], struct fuse_file_info *fi)
{
	INC(op_count[OP_UTIMENS], 1);
	charge_meta();
	int r = fi ? futimens(H(fi)->fd, tv)
		   : utimensat(root_fd, rel(path), tv, AT_SYMLINK_NOFOLLOW);
	return r == -1 ? -errno : 0;
}

static int emu_open(const char *path, struct fuse_file_info *fi)
{
	if (is_stats(path)) {
		struct handle *h = calloc(1, sizeof(*h));
		if (!h)
			return -ENOMEM;
		h->fd = -1;
		h->snap = malloc(8192);
		if (!h->snap) {
			free(h);
			return -ENOMEM;
		}
		h->snap_len = stats_json(h->snap, 8192);
		fi->fh = (uintptr_t)h;
		fi->direct_io = 1;
		return 0;
	}
	INC(op_count[OP_OPEN], 1);
	charge_meta();
	/* O_DIRECT is the client's business (FUSE handles it in the kernel), as an NFS server
	 * never sees it: passed on, the backing filesystem would refuse our unaligned buffers */
	int fd = openat(root_fd, rel(path), (fi->flags & ~(O_NOFOLLOW | O_DIRECT)) | O_CLOEXEC);
	if (fd == -1)
		return -errno;
	return new_handle(fi, fd);
}

static int emu_create(const char *path, mode_t mode, struct fuse_file_info *fi)
{
	INC(op_count[OP_CREATE], 1);
	if (is_stats(path))
		return -EEXIST;
	charge_meta();
	int fd = openat(root_fd, rel(path), (fi->flags & ~O_DIRECT) | O_CREAT | O_CLOEXEC, mode);
	if (fd == -1)
		return -errno;
	return new_handle(fi, fd);
}

static int emu_read(const char *path, char *buf, size_t size, off_t off,
		    struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = H(fi);
	if (h->snap) {
		if ((size_t)off >= h->snap_len)
			return 0;
		size_t n = h->snap_len - (size_t)off;
		if (n > size)
			n = size;
		memcpy(buf, h->snap + off, n);
		return (int)n;
	}
	INC(op_count[OP_READ], 1);
	charge_bytes(size);
	ssize_t n = pread(h->fd, buf, size, off);
	if (n == -1)
		return -errno;
	INC(bytes_read, (uint64_t)n);
	return (int)n;
}

static int emu_write(const char *path, const char *buf, size_t size, off_t off,
		     struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = H(fi);
	if (h->snap)
		return -EBADF;
	INC(op_count[OP_WRITE], 1);
	hold_if_paused();
	charge_bytes(size);
	ssize_t n = pwrite(h->fd, buf, size, off);
	if (n == -1)
		return -errno;
	INC(bytes_written, (uint64_t)n);
	return (int)n;
}

static int emu_statfs(const char *path, struct statvfs *st)
{
	(void)path;
	INC(op_count[OP_STATFS], 1);
	return fstatvfs(root_fd, st) == -1 ? -errno : 0;
}

static int emu_flush(const char *path, struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = H(fi);
	if (h->snap)
		return 0;
	INC(op_count[OP_FLUSH], 1);
	/* close a duplicate so close-time semantics (locks, errors) reach the backing fs */
	int fd = dup(h->fd);
	if (fd == -1)
		return -errno;
	return close(fd) == -1 ? -errno : 0;
}

static int emu_release(const char *path, struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = H(fi);
	if (!h->snap)
		INC(op_count[OP_RELEASE], 1);
	if (h->fd >= 0)
		close(h->fd);
	free(h->snap);
	free(h);
	return 0;
}

static int emu_fsync(const char *path, int datasync, struct fuse_file_info *fi)
{
	(void)path;
	struct handle *h = H(fi);
	if (h->snap)
		return 0;
	INC(op_count[OP_FSYNC], 1);
	charge_meta();
	if (fail_fsyncs)
		return -EIO;
	int r = datasync ? fdatasync(h->fd) : fsync(h->fd);
	return r == -1 ? -errno : 0;
}

static int emu_fallocate(const char *path, int mode, off_t off, off_t len,
			 struct fuse_file_info *fi)
{
	(void)path;
	INC(op_count[OP_FALLOCATE], 1);
	if (H(fi)->snap)
		return -EBADF;
	return fallocate(H(fi)->fd, mode, off, len) == -1 ? -errno : 0;
}

struct dir_handle {
	DIR *dp;
	struct dirent *entry;
	off_t offset;
};

static int emu_opendir(const char *path, struct fuse_file_info *fi)
{
	INC(op_count[OP_OPENDIR], 1);
	struct dir_handle *d = calloc(1, sizeof(*d));
	if (!d)
		return -ENOMEM;
	int fd = openat(root_fd, rel(path), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd == -1 || !(d->dp = fdopendir(fd))) {
		int e = errno;
		if (fd != -1)
			close(fd);
		free(d);
		return -e;
	}
	fi->fh = (uintptr_t)d;
	return 0;
}

static int emu_readdir(const char *path, void *buf, fuse_fill_dir_t filler, off_t offset,
		       struct fuse_file_info *fi, enum fuse_readdir_flags flags)
{
	(void)path;
	(void)flags;
	INC(op_count[OP_READDIR], 1);
	struct dir_handle *d = (struct dir_handle *)(uintptr_t)fi->fh;
	if (offset != d->offset) {
		seekdir(d->dp, offset);
		d->entry = NULL;
		d->offset = offset;
	}
	for (;;) {
		if (!d->entry) {
			errno = 0;
			d->entry = readdir(d->dp);
			if (!d->entry) {
				if (errno)
					return -errno;
				break;
			}
		}
		struct stat st;
		memset(&st, 0, sizeof(st));
		st.st_ino = d->entry->d_ino;
		st.st_mode = (mode_t)d->entry->d_type << 12;
		off_t next = telldir(d->dp);
		if (filler(buf, d->entry->d_name, &st, next, 0))
			break;
		d->entry = NULL;
		d->offset = next;
	}
	return 0;
}

static int emu_releasedir(const char *path, struct fuse_file_info *fi)
{
	(void)path;
	INC(op_count[OP_RELEASEDIR], 1);
	struct dir_handle *d = (struct dir_handle *)(uintptr_t)fi->fh;
	closedir(d->dp);
	free(d);
	return 0;
}

static int emu_fsyncdir(const char *path, int datasync, struct fuse_file_info *fi)
{
	(void)path;
	INC(op_count[OP_FSYNCDIR], 1);
	charge_meta();
	if (fail_fsyncs)
		return -EIO;
	struct dir_handle *d = (struct dir_handle *)(uintptr_t)fi->fh;
	int fd = dirfd(d->dp);
	int r = datasync ? fdatasync(fd) : fsync(fd);
	return r == -1 ? -errno : 0;
}

static const struct fuse_operations emu_ops = {
	.init = emu_init,
	.destroy = emu_destroy,
	.getattr = emu_getattr,
	.access = emu_access,
	.readlink = emu_readlink,
	.mknod = emu_mknod,
	.mkdir = emu_mkdir,
	.unlink = emu_unlink,
	.rmdir = emu_rmdir,
	.symlink = emu_symlink,
	.rename = emu_rename,
	.link = emu_link,
	.chmod = emu_chmod,
	.chown = emu_chown,
	.truncate = emu_truncate,
	.utimens = emu_utimens,
	.open = emu_open,
	.create = emu_create,
	.read = emu_read,
	.write = emu_write,
	.statfs = emu_statfs,
	.flush = emu_flush,
	.release = emu_release,
	.fsync = emu_fsync,
	.fallocate = emu_fallocate,
	.opendir = emu_opendir,
	.readdir = emu_readdir,
	.releasedir = emu_releasedir,
	.fsyncdir = emu_fsyncdir,
};

/* ---------------------------------------------------------------- main */

static int opt_proc(void *data, const char *arg, int key, struct fuse_args *outargs)
{
	(void)data;
	(void)outargs;
	if (key == FUSE_OPT_KEY_NONOPT && !backing) {
		backing = realpath(arg, NULL);
		if (!backing) {
			fprintf(stderr, "nasemu: backing directory %s: %s\n", arg, strerror(errno));
			exit(2);
		}
		return 0; /* consumed; the next non-option is the mountpoint, for fuse */
	}
	return 1;
}

static void usage(const char *prog)
{
	printf("usage: %s BACKING MOUNTPOINT [options]\n\n"
	       "  --meta-latency-us N    round trip charged per metadata op (default 1000)\n"
	       "  --meta-ops-per-sec N   shared metadata ops/s, 0 = unlimited (default 3000)\n"
	       "  --meta-burst N         ops the metadata bucket lets through at once (default 32)\n"
	       "  --bandwidth-mbps N     shared read+write MB/s (10^6 B/s), 0 = unlimited"
	       " (default 2000)\n"
	       "  --threads N            max FUSE worker threads (default 64)\n"
	       "  --direct-io            open files with direct_io (no client page cache)\n"
	       "  --direct-io-writes     direct_io only for files opened for writing\n"
	       "  SIGUSR1 / SIGUSR2      hold / release all data writes (to build a backlog)\n"
	       "  SIGRTMIN / SIGRTMIN+1  fail / stop failing every fsync with EIO\n"
	       "  --stats-file PATH      write the counters as JSON here at unmount\n"
	       "  counters: read MOUNTPOINT" STATS_NAME " (JSON)\n\n", prog);
}

int main(int argc, char *argv[])
{
	struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
	if (fuse_opt_parse(&args, &opt, option_spec, opt_proc) == -1)
		return 2;
	if (opt.show_help) {
		usage(argv[0]);
		fuse_opt_add_arg(&args, "--help");
		args.argv[0][0] = '\0';
		return fuse_main(args.argc, args.argv, &emu_ops, NULL);
	}
	if (!backing) {
		usage(argv[0]);
		return 2;
	}
	root_fd = open(backing, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (root_fd == -1) {
		fprintf(stderr, "nasemu: open %s: %s\n", backing, strerror(errno));
		return 2;
	}
	if (opt.stats_file && opt.stats_file[0] != '/') {
		char *abs = realpath(".", NULL);
		if (abs) {
			char *p;
			if (asprintf(&p, "%s/%s", abs, opt.stats_file) > 0)
				opt.stats_file = p;
			free(abs);
		}
	}
	clock_gettime(CLOCK_MONOTONIC, &t_start);
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_pause;
	sa.sa_flags = SA_RESTART;
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGUSR2, &sa, NULL);
	sa.sa_handler = on_fsync_fault;
	sigaction(SIGRTMIN, &sa, NULL);
	sigaction(SIGRTMIN + 1, &sa, NULL);
	char thr[128];
	snprintf(thr, sizeof(thr), "-omax_threads=%u,max_idle_threads=16,fsname=nasemu,subtype=nasemu",
		 opt.threads ? opt.threads : 64);
	fuse_opt_add_arg(&args, thr);
	int r = fuse_main(args.argc, args.argv, &emu_ops, NULL);
	fuse_opt_free_args(&args);
	return r;
}
