/*
 * birdenv.replicas._overlay: a copy-on-write page-overlay SQLite VFS.
 *
 * One session = a private sparse file P (same byte layout as the logical database), a side file
 * P-ovl (header + block bitmap) and a read-only base file B named by the `base=` URI parameter.
 * Block i of the logical file comes from P when bit i is set, else from B when it lies below the
 * "base limit" (which only ever shrinks, on truncation), else it reads as zeros.
 *
 * Design rules, each one load-bearing:
 *  - The VFS behaves exactly like a plain file whose every xWrite/xTruncate is persisted (to the
 *    OS page cache) before it returns.  SQLite's own journal/WAL protocol then gives crash safety:
 *    data blocks are written to P first, their bits second, the header (size, generation) last,
 *    so a SIGKILL at any point leaves a state that hot-journal rollback or WAL recovery repairs.
 *    Nothing is deferred to xSync/xUnlock, because with synchronous=OFF the journal is deleted
 *    before the write lock is released.
 *  - P carries the session's real POSIX locks: all locking and shared memory is delegated to a
 *    default-VFS ("unix") file opened on P.  We never open P with a raw fd (closing one would drop
 *    the process's POSIX locks on it).
 *  - Another connection to the same session may change P-ovl.  The header carries a generation
 *    number; it is checked (one 64-byte pread) whenever a file lock or a WAL shm lock is taken,
 *    and the bitmap is reloaded when it changed.  SQLite's locking guarantees nobody writes the
 *    blocks a reader uses while it holds those locks.
 *  - A write whose content equals the current view of a block with a clear bit is skipped: no
 *    private bytes for rewrites of identical pages, and a journal rollback (which only rewrites
 *    original content) can never fail on the maxbytes cap.
 *  - No global mutable state except the registered sqlite3_vfs structs and the table of shared
 *    base descriptors (under its own mutex): every session of a process on the same base reads
 *    it through one read-only descriptor, so a session costs no descriptor for its base.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define OVL_BLK 512 /* the smallest SQLite page size: no read-modify-write for real pages */
#define OVL_HDR 64  /* header bytes at the start of P-ovl; the bitmap follows */
#define OVL_VERSION 1
#define GEN_UNKNOWN UINT64_MAX
#define STACK_BLOCKS 256

typedef sqlite3_int64 i64;

static const uint8_t OVL_MAGIC[8] = {'B', 'I', 'R', 'D', 'O', 'V', 'L', '1'};

typedef struct OvlFile {
  sqlite3_file base;    /* must be first */
  sqlite3_file *pReal;  /* default-VFS file (P for main dbs), stored right after this struct */
  sqlite3_vfs *pVfs;    /* our VFS (for its name) */
  i64 maxBytes;         /* cap on private data / journal / WAL bytes; 0 = none */
  /* main database only */
  int baseFd;           /* B, O_RDONLY, shared with the process's other sessions on B */
  int ovlFd;            /* P-ovl, or -1 (read-only session without one) */
  int readOnly;
  int lockLevel;
  int hdrDirty;         /* a change whose header write failed: retry on sync/unlock */
  uint64_t gen;         /* generation of the side-file state we hold in memory */
  i64 size;             /* logical file size */
  i64 baseLimit;        /* bytes of B still visible (shrinks on truncation, never grows) */
  i64 baseSize;         /* st_size of B at open (also recorded in the header) */
  uint8_t *bits;        /* block bitmap, capBytes long, bits >= nblocks(size) always clear */
  i64 capBytes;
  i64 nSet;             /* number of set bits = private data blocks */
  char *zOvl;           /* path of P-ovl */
} OvlFile;

typedef struct OvlHdr {
  uint64_t gen;
  i64 size, baseLimit, baseSize;
} OvlHdr;

#define ORIG_VFS(v) ((sqlite3_vfs *)((v)->pAppData))

static i64 nblocks(i64 size) { return (size + OVL_BLK - 1) / OVL_BLK; }
static i64 imin(i64 a, i64 b) { return a < b ? a : b; }
static i64 imax(i64 a, i64 b) { return a > b ? a : b; }

/* ---------------------------------------------------------------- raw I/O helpers */

/* pread until n bytes or EOF; returns bytes read or -1. */
static i64 readFull(int fd, void *buf, i64 n, i64 off) {
  i64 got = 0;
  while (got < n) {
    ssize_t r = pread(fd, (char *)buf + got, (size_t)(n - got), (off_t)(off + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) break;
    got += r;
  }
  return got;
}

/* pwrite all n bytes; 0 or -1 with errno. */
static int writeFull(int fd, const void *buf, i64 n, i64 off) {
  i64 done = 0;
  while (done < n) {
    ssize_t r = pwrite(fd, (const char *)buf + done, (size_t)(n - done), (off_t)(off + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) {
      errno = ENOSPC;
      return -1;
    }
    done += r;
  }
  return 0;
}

static int errWrite(int e) { return (e == ENOSPC || e == EDQUOT) ? SQLITE_FULL : SQLITE_IOERR_WRITE; }

static int isZero(const uint8_t *p, i64 n) {
  for (i64 i = 0; i < n; i++)
    if (p[i]) return 0;
  return 1;
}

/* ---------------------------------------------------------------- bitmap */

static int testBit(const OvlFile *p, i64 blk) {
  i64 byte = blk >> 3;
  return byte < p->capBytes && (p->bits[byte] >> (blk & 7)) & 1;
}

static int ensureCap(OvlFile *p, i64 nbytes) {
  if (nbytes <= p->capBytes) return SQLITE_OK;
  i64 ncap = imax(imax(nbytes, p->capBytes * 2), 64);
  uint8_t *nb = sqlite3_realloc64(p->bits, (sqlite3_uint64)ncap);
  if (!nb) return SQLITE_NOMEM;
  memset(nb + p->capBytes, 0, (size_t)(ncap - p->capBytes));
  p->bits = nb;
  p->capBytes = ncap;
  return SQLITE_OK;
}

/* ---------------------------------------------------------------- side-file header */

static void put64(uint8_t *b, uint64_t v) {
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get64(const uint8_t *b) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)b[i] << (8 * i);
  return v;
}
static uint64_t fnv1a(const uint8_t *b, int n) {
  uint64_t h = 1469598103934665603ULL;
  for (int i = 0; i < n; i++) {
    h ^= b[i];
    h *= 1099511628211ULL;
  }
  return h;
}

static void encodeHdr(uint8_t *out, const OvlHdr *h) {
  memset(out, 0, OVL_HDR);
  memcpy(out, OVL_MAGIC, 8);
  put64(out + 8, (uint64_t)OVL_VERSION | ((uint64_t)OVL_BLK << 32));
  put64(out + 16, h->gen);
  put64(out + 24, (uint64_t)h->size);
  put64(out + 32, (uint64_t)h->baseLimit);
  put64(out + 40, (uint64_t)h->baseSize);
  put64(out + 56, fnv1a(out, 56));
}

/* 0: header read; 1: no header yet (missing, empty or all-zero file start); SQLITE_* error < 0
 * is returned as the negative of the code. A torn header (checksum mismatch: we raced a writer
 * in another process) is retried. */
static int readHdr(OvlFile *p, OvlHdr *h) {
  uint8_t b[OVL_HDR];
  if (p->ovlFd < 0) return 1;
  for (int attempt = 0; attempt < 2000; attempt++) {
    i64 n = readFull(p->ovlFd, b, OVL_HDR, 0);
    if (n < 0) return -SQLITE_IOERR_READ;
    if (n == 0 || (n == OVL_HDR && isZero(b, OVL_HDR))) return 1;
    if (n == OVL_HDR && memcmp(b, OVL_MAGIC, 8) == 0 && get64(b + 56) == fnv1a(b, 56)) {
      if (get64(b + 8) != ((uint64_t)OVL_VERSION | ((uint64_t)OVL_BLK << 32))) return -SQLITE_CORRUPT;
      h->gen = get64(b + 16);
      h->size = (i64)get64(b + 24);
      h->baseLimit = (i64)get64(b + 32);
      h->baseSize = (i64)get64(b + 40);
      if (h->size < 0 || h->baseLimit < 0 || h->baseLimit > h->size) return -SQLITE_CORRUPT;
      return 0;
    }
    if (n == OVL_HDR && memcmp(b, OVL_MAGIC, 8) != 0 && !isZero(b, 8)) return -SQLITE_CORRUPT;
    sched_yield();
  }
  return -SQLITE_CORRUPT;
}

static int writeHdr(OvlFile *p) {
  uint8_t b[OVL_HDR];
  OvlHdr h;
  if (p->ovlFd < 0) return SQLITE_READONLY;
  h.gen = (p->gen == GEN_UNKNOWN ? 0 : p->gen) + 1;
  h.size = p->size;
  h.baseLimit = p->baseLimit;
  h.baseSize = p->baseSize;
  encodeHdr(b, &h);
  if (writeFull(p->ovlFd, b, OVL_HDR, 0)) {
    p->hdrDirty = 1;
    return errWrite(errno);
  }
  p->gen = h.gen;
  p->hdrDirty = 0;
  return SQLITE_OK;
}

/* Reload the in-memory state from P-ovl if its generation differs from ours (or always). */
static int ovlRefresh(OvlFile *p, int force) {
  OvlHdr h;
  int r = readHdr(p, &h);
  if (r < 0) return -r;
  if (r == 1) {
    h.gen = 0;
    h.size = h.baseLimit = h.baseSize = p->baseSize;
  }
  if (h.baseSize != p->baseSize) return SQLITE_CORRUPT; /* base replaced or session reused */
  if (!force && h.gen == p->gen) return SQLITE_OK;
  i64 nb = nblocks(h.size), nbytes = (nb + 7) / 8;
  int rc = ensureCap(p, nbytes);
  if (rc) return rc;
  p->gen = GEN_UNKNOWN; /* until the reload below is complete */
  memset(p->bits, 0, (size_t)p->capBytes);
  if (r == 0 && nbytes > 0 && readFull(p->ovlFd, p->bits, nbytes, OVL_HDR) < 0)
    return SQLITE_IOERR_READ;
  if (nb & 7) p->bits[nbytes - 1] &= (uint8_t)((1u << (nb & 7)) - 1);
  i64 cnt = 0;
  for (i64 i = 0; i < nbytes; i++) cnt += __builtin_popcount(p->bits[i]);
  p->nSet = cnt;
  p->size = h.size;
  p->baseLimit = h.baseLimit;
  p->gen = h.gen;
  p->hdrDirty = 0;
  return SQLITE_OK;
}

/* Persist bitmap bytes [lo, hi) then the header (bumping the generation). On failure the
 * in-memory state is reloaded from disk, which is consistent because bits are only ever written
 * after the data blocks they describe. */
static int ovlPersist(OvlFile *p, i64 lo, i64 hi) {
  int rc = SQLITE_OK;
  if (p->ovlFd < 0) return SQLITE_READONLY;
  if (hi > lo && writeFull(p->ovlFd, p->bits + lo, hi - lo, OVL_HDR + lo)) rc = errWrite(errno);
  if (rc == SQLITE_OK) rc = writeHdr(p);
  if (rc != SQLITE_OK && ovlRefresh(p, 1) != SQLITE_OK) p->gen = GEN_UNKNOWN;
  return rc;
}

/* ---------------------------------------------------------------- reading the view */

enum { SRC_ZERO, SRC_PRIV, SRC_BASE };

/* The source of the bytes at pos and where that source (within pos's block) ends. */
static void viewSeg(const OvlFile *p, i64 pos, i64 end, int *src, i64 *segEnd) {
  i64 e = imin(end, (pos / OVL_BLK + 1) * OVL_BLK);
  if (pos >= p->size) {
    *src = SRC_ZERO;
    *segEnd = end;
  } else if (testBit(p, pos / OVL_BLK)) {
    *src = SRC_PRIV;
    *segEnd = imin(e, p->size);
  } else if (pos < p->baseLimit) {
    *src = SRC_BASE;
    *segEnd = imin(e, p->baseLimit);
  } else {
    *src = SRC_ZERO;
    *segEnd = e;
  }
}

/* Fill buf with the logical bytes [off, off+n), zeros past the end; runs of blocks with the same
 * source are read with one call. */
static int readView(OvlFile *p, uint8_t *buf, i64 off, i64 n) {
  i64 pos = off, end = off + n;
  while (pos < end) {
    int src, s2;
    i64 segEnd, e2;
    viewSeg(p, pos, end, &src, &segEnd);
    while (segEnd < end) {
      viewSeg(p, segEnd, end, &s2, &e2);
      if (s2 != src) break;
      segEnd = e2;
    }
    uint8_t *dst = buf + (pos - off);
    i64 len = segEnd - pos;
    if (src == SRC_ZERO) {
      memset(dst, 0, (size_t)len);
    } else if (src == SRC_PRIV) {
      int rc = p->pReal->pMethods->xRead(p->pReal, dst, (int)len, pos);
      /* a short read past P's end is zero-filled by the unix VFS: that is the right content */
      if (rc != SQLITE_OK && rc != SQLITE_IOERR_SHORT_READ) return rc;
    } else {
      i64 got = readFull(p->baseFd, dst, len, pos);
      if (got < 0) return SQLITE_IOERR_READ;
      if (got < len) memset(dst + got, 0, (size_t)(len - got));
    }
    pos = segEnd;
  }
  return SQLITE_OK;
}

/* ---------------------------------------------------------------- shared base descriptors */

/* One read-only descriptor per base file (by device and inode) for the whole process, counted by
 * the sessions using it. Reads use pread, which needs no shared file offset. While a descriptor is
 * open its inode cannot be reused, so a base replaced on disk gets a new entry, never the old
 * bytes. */
typedef struct BaseRef {
  dev_t dev;
  ino_t ino;
  int fd;
  int nRef;
  struct BaseRef *next;
} BaseRef;

static BaseRef *baseRefs;
static pthread_mutex_t baseMutex = PTHREAD_MUTEX_INITIALIZER;

/* A child forked while another thread held the mutex must not inherit it locked. */
static void baseAtforkPrepare(void) { pthread_mutex_lock(&baseMutex); }
static void baseAtforkRelease(void) { pthread_mutex_unlock(&baseMutex); }

/* The shared descriptor of the regular file zPath (opened on first use) and its size. */
static int baseAcquire(const char *zPath, int *pFd, i64 *pSize) {
  struct stat st;
  BaseRef *r;
  int fd, rc = SQLITE_OK;
  if (stat(zPath, &st) != 0 || !S_ISREG(st.st_mode)) return SQLITE_CANTOPEN;
  pthread_mutex_lock(&baseMutex);
  for (r = baseRefs; r && !(r->dev == st.st_dev && r->ino == st.st_ino); r = r->next) {
  }
  if (r) {
    r->nRef++;
    *pFd = r->fd;
    *pSize = st.st_size;
    goto out;
  }
  do {
    fd = open(zPath, O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  /* the path may have been replaced since stat(): describe the file really opened */
  if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || !(r = malloc(sizeof(*r)))) {
    if (fd >= 0) close(fd);
    rc = SQLITE_CANTOPEN;
    goto out;
  }
  r->dev = st.st_dev;
  r->ino = st.st_ino;
  r->fd = fd;
  r->nRef = 1;
  r->next = baseRefs;
  baseRefs = r;
  *pFd = fd;
  *pSize = st.st_size;
out:
  pthread_mutex_unlock(&baseMutex);
  return rc;
}

static void baseRelease(int fd) {
  BaseRef **pp, *r;
  pthread_mutex_lock(&baseMutex);
  for (pp = &baseRefs; (r = *pp) && r->fd != fd; pp = &r->next) {
  }
  if (r && --r->nRef == 0) {
    *pp = r->next;
    close(r->fd);
    free(r);
  }
  pthread_mutex_unlock(&baseMutex);
}

/* ---------------------------------------------------------------- main-db io methods */

static int ovlClose(sqlite3_file *pFile) {
  OvlFile *p = (OvlFile *)pFile;
  int rc = SQLITE_OK;
  if (p->pReal->pMethods) rc = p->pReal->pMethods->xClose(p->pReal);
  if (p->baseFd >= 0) baseRelease(p->baseFd);
  if (p->ovlFd >= 0) close(p->ovlFd);
  sqlite3_free(p->bits);
  sqlite3_free(p->zOvl);
  p->baseFd = p->ovlFd = -1;
  p->bits = NULL;
  p->zOvl = NULL;
  return rc;
}

static int ovlRead(sqlite3_file *pFile, void *zBuf, int iAmt, i64 iOfst) {
  OvlFile *p = (OvlFile *)pFile;
  if (iOfst >= p->size) {
    memset(zBuf, 0, (size_t)iAmt);
    return SQLITE_IOERR_SHORT_READ;
  }
  if (iOfst + iAmt > p->size) {
    i64 n = p->size - iOfst;
    int rc = readView(p, zBuf, iOfst, n);
    if (rc) return rc;
    memset((uint8_t *)zBuf + n, 0, (size_t)(iAmt - n));
    return SQLITE_IOERR_SHORT_READ;
  }
  return readView(p, zBuf, iOfst, iAmt);
}

static int ovlWrite(sqlite3_file *pFile, const void *zBuf, int iAmt, i64 iOfst) {
  OvlFile *p = (OvlFile *)pFile;
  if (p->readOnly || p->ovlFd < 0) return SQLITE_READONLY;
  if (iAmt <= 0) return SQLITE_OK;
  const i64 S = iOfst / OVL_BLK * OVL_BLK;
  const i64 E = (iOfst + iAmt + OVL_BLK - 1) / OVL_BLK * OVL_BLK;
  const i64 nb = (E - S) / OVL_BLK, b0 = S / OVL_BLK;
  const uint8_t *data = zBuf;
  uint8_t *tmp = NULL, *cmp = NULL, *need = NULL;
  uint8_t needStack[STACK_BLOCKS];
  i64 newBits = 0, i, j, k;
  int rc = SQLITE_OK;

  if (S != iOfst || E != iOfst + iAmt) {
    /* partial blocks: compose whole blocks from the current view (never happens for pages) */
    tmp = sqlite3_malloc64((sqlite3_uint64)(E - S));
    if (!tmp) return SQLITE_NOMEM;
    rc = readView(p, tmp, S, E - S);
    if (rc) goto out;
    memcpy(tmp + (iOfst - S), zBuf, (size_t)iAmt);
    data = tmp;
  }
  need = nb <= STACK_BLOCKS ? needStack : sqlite3_malloc64((sqlite3_uint64)nb);
  if (!need) {
    rc = SQLITE_NOMEM;
    goto out;
  }
  /* need[k]: 0 = nothing to do (clear bit, same content as the view), 1 = write through,
   * 2 = write and set the bit */
  for (i = 0; i < nb;) {
    if (testBit(p, b0 + i)) {
      need[i++] = 1;
      continue;
    }
    for (j = i; j < nb && !testBit(p, b0 + j); j++) {
    }
    const i64 rs = S + i * OVL_BLK, re = S + j * OVL_BLK, be = imin(re, p->baseLimit);
    if (be > rs) {
      if (!cmp && !(cmp = sqlite3_malloc64((sqlite3_uint64)(E - S)))) {
        rc = SQLITE_NOMEM;
        goto out;
      }
      i64 got = readFull(p->baseFd, cmp + (rs - S), be - rs, rs);
      if (got < 0) {
        rc = SQLITE_IOERR_READ;
        goto out;
      }
      if (got < be - rs) memset(cmp + (rs - S) + got, 0, (size_t)(be - rs - got));
    }
    for (k = i; k < j; k++) {
      const i64 bs = S + k * OVL_BLK;
      const uint8_t *d = data + (bs - S);
      int eq;
      if (bs + OVL_BLK <= be)
        eq = memcmp(d, cmp + (bs - S), OVL_BLK) == 0;
      else if (bs >= be)
        eq = isZero(d, OVL_BLK);
      else
        eq = memcmp(d, cmp + (bs - S), (size_t)(be - bs)) == 0 &&
             isZero(d + (be - bs), bs + OVL_BLK - be);
      need[k] = eq ? 0 : 2;
      newBits += !eq;
    }
    i = j;
  }
  if (p->maxBytes > 0 && newBits > 0 && (p->nSet + newBits) * OVL_BLK > p->maxBytes) {
    rc = SQLITE_FULL;
    goto out;
  }
  for (i = 0; i < nb;) {
    if (!need[i]) {
      i++;
      continue;
    }
    for (j = i; j < nb && need[j]; j++) {
    }
    rc = p->pReal->pMethods->xWrite(p->pReal, data + i * OVL_BLK, (int)((j - i) * OVL_BLK),
                                    S + i * OVL_BLK);
    if (rc) goto out; /* bits untouched: the view keeps the old content of clear blocks */
    i = j;
  }
  {
    const i64 oldSize = p->size, newSize = imax(oldSize, iOfst + iAmt);
    const i64 oldNb = nblocks(oldSize), newNb = nblocks(newSize);
    i64 lo = -1, hi = -1; /* bit range to persist */
    rc = ensureCap(p, (newNb + 7) / 8);
    if (rc) goto out;
    for (k = 0; k < nb; k++) {
      if (need[k] != 2) continue;
      const i64 blk = b0 + k;
      p->bits[blk >> 3] |= (uint8_t)(1u << (blk & 7));
      p->nSet++;
      if (lo < 0) lo = blk;
      hi = blk;
    }
    if (newNb > oldNb) { /* rewrite the grown range so no stale on-disk bit can resurface */
      lo = lo < 0 ? oldNb : imin(lo, oldNb);
      hi = imax(hi, newNb - 1);
    }
    p->size = newSize;
    if (lo >= 0 || newSize != oldSize)
      rc = ovlPersist(p, lo >= 0 ? lo / 8 : 0, lo >= 0 ? hi / 8 + 1 : 0);
  }
out:
  if (need && need != needStack) sqlite3_free(need);
  sqlite3_free(tmp);
  sqlite3_free(cmp);
  return rc;
}

static int ovlTruncate(sqlite3_file *pFile, i64 size) {
  OvlFile *p = (OvlFile *)pFile;
  int rc;
  if (p->readOnly || p->ovlFd < 0) return SQLITE_READONLY;
  if (size < 0) size = 0;
  const i64 oldSize = p->size, oldNb = nblocks(oldSize), newNb = nblocks(size);
  if (size == oldSize) return SQLITE_OK;
  if (size > oldSize) { /* growing: the new tail reads as zeros (bits there are clear) */
    rc = ensureCap(p, (newNb + 7) / 8);
    if (rc) return rc;
    p->size = size;
    return newNb > oldNb ? ovlPersist(p, oldNb / 8, (newNb - 1) / 8 + 1) : ovlPersist(p, 0, 0);
  }
  for (i64 b = newNb; b < oldNb; b++) {
    if (testBit(p, b)) {
      p->bits[b >> 3] &= (uint8_t)~(1u << (b & 7));
      p->nSet--;
    }
  }
  p->size = size;
  if (p->baseLimit > size) p->baseLimit = size; /* truncated base blocks never come back */
  i64 realSize = 0;
  rc = p->pReal->pMethods->xFileSize(p->pReal, &realSize);
  if (rc == SQLITE_OK && realSize > size) rc = p->pReal->pMethods->xTruncate(p->pReal, size);
  if (rc != SQLITE_OK) {
    if (ovlRefresh(p, 1) != SQLITE_OK) p->gen = GEN_UNKNOWN;
    return rc;
  }
  /* persist: the partial last bitmap byte, cut the bitmap, then the header */
  const i64 nbytes = (newNb + 7) / 8;
  if ((newNb & 7) && writeFull(p->ovlFd, p->bits + nbytes - 1, 1, OVL_HDR + nbytes - 1))
    rc = errWrite(errno);
  if (rc == SQLITE_OK && ftruncate(p->ovlFd, OVL_HDR + nbytes) != 0) rc = SQLITE_IOERR_TRUNCATE;
  if (rc == SQLITE_OK) return ovlPersist(p, 0, 0);
  if (ovlRefresh(p, 1) != SQLITE_OK) p->gen = GEN_UNKNOWN;
  return rc;
}

static int ovlSync(sqlite3_file *pFile, int flags) {
  OvlFile *p = (OvlFile *)pFile;
  int rc = p->pReal->pMethods->xSync(p->pReal, flags); /* data before the bits that point at it */
  if (rc) return rc;
  if (p->hdrDirty && (rc = writeHdr(p)) != SQLITE_OK) return rc;
  if (p->ovlFd >= 0 && !p->readOnly && fdatasync(p->ovlFd) != 0) return SQLITE_IOERR_FSYNC;
  return SQLITE_OK;
}

static int ovlFileSize(sqlite3_file *pFile, i64 *pSize) {
  *pSize = ((OvlFile *)pFile)->size;
  return SQLITE_OK;
}

static int ovlLock(sqlite3_file *pFile, int level) {
  OvlFile *p = (OvlFile *)pFile;
  const int prev = p->lockLevel;
  int rc = p->pReal->pMethods->xLock(p->pReal, level);
  if (rc) return rc;
  if (level > p->lockLevel) p->lockLevel = level;
  rc = ovlRefresh(p, p->gen == GEN_UNKNOWN);
  if (rc && prev == SQLITE_LOCK_NONE) {
    p->pReal->pMethods->xUnlock(p->pReal, SQLITE_LOCK_NONE);
    p->lockLevel = SQLITE_LOCK_NONE;
  }
  return rc;
}

static int ovlUnlock(sqlite3_file *pFile, int level) {
  OvlFile *p = (OvlFile *)pFile;
  if (p->hdrDirty && p->lockLevel >= SQLITE_LOCK_RESERVED) writeHdr(p); /* best effort */
  int rc = p->pReal->pMethods->xUnlock(p->pReal, level);
  if (rc == SQLITE_OK && level < p->lockLevel) p->lockLevel = level;
  return rc;
}

static int ovlCheckReservedLock(sqlite3_file *pFile, int *pResOut) {
  OvlFile *p = (OvlFile *)pFile;
  return p->pReal->pMethods->xCheckReservedLock(p->pReal, pResOut);
}

static int ovlFileControl(sqlite3_file *pFile, int op, void *pArg) {
  OvlFile *p = (OvlFile *)pFile;
  switch (op) {
    case SQLITE_FCNTL_SIZE_HINT:  /* would preallocate P to the logical size */
    case SQLITE_FCNTL_CHUNK_SIZE: /* same */
      return SQLITE_OK;
    case SQLITE_FCNTL_VFSNAME: {
      int rc = p->pReal->pMethods->xFileControl(p->pReal, op, pArg);
      char *inner = rc == SQLITE_OK ? *(char **)pArg : NULL;
      *(char **)pArg = inner ? sqlite3_mprintf("%s/%z", p->pVfs->zName, inner)
                             : sqlite3_mprintf("%s", p->pVfs->zName);
      return SQLITE_OK;
    }
    default:
      return p->pReal->pMethods->xFileControl(p->pReal, op, pArg);
  }
}

static int ovlSectorSize(sqlite3_file *pFile) {
  OvlFile *p = (OvlFile *)pFile;
  return p->pReal->pMethods->xSectorSize(p->pReal);
}

static int ovlDeviceCharacteristics(sqlite3_file *pFile) {
  OvlFile *p = (OvlFile *)pFile;
  /* our writes are several syscalls: never claim atomic or batch-atomic writes */
  return p->pReal->pMethods->xDeviceCharacteristics(p->pReal) &
         ~(0x1ff | SQLITE_IOCAP_BATCH_ATOMIC | SQLITE_IOCAP_SAFE_APPEND | SQLITE_IOCAP_SEQUENTIAL);
}

static int ovlShmMap(sqlite3_file *pFile, int iPg, int pgsz, int bExtend, void volatile **pp) {
  OvlFile *p = (OvlFile *)pFile;
  return p->pReal->pMethods->xShmMap(p->pReal, iPg, pgsz, bExtend, pp);
}

static int ovlShmLock(sqlite3_file *pFile, int offset, int n, int flags) {
  OvlFile *p = (OvlFile *)pFile;
  int rc = p->pReal->pMethods->xShmLock(p->pReal, offset, n, flags);
  if (rc == SQLITE_OK && (flags & SQLITE_SHM_LOCK)) {
    /* a WAL read/write/checkpoint lock: another connection may have checkpointed into P */
    rc = ovlRefresh(p, p->gen == GEN_UNKNOWN);
    if (rc)
      p->pReal->pMethods->xShmLock(p->pReal, offset, n,
                                   (flags & ~SQLITE_SHM_LOCK) | SQLITE_SHM_UNLOCK);
  }
  return rc;
}

static void ovlShmBarrier(sqlite3_file *pFile) {
  OvlFile *p = (OvlFile *)pFile;
  p->pReal->pMethods->xShmBarrier(p->pReal);
}

static int ovlShmUnmap(sqlite3_file *pFile, int deleteFlag) {
  OvlFile *p = (OvlFile *)pFile;
  return p->pReal->pMethods->xShmUnmap(p->pReal, deleteFlag);
}

/* Version 2: shared memory, but no xFetch, so SQLite never memory-maps P directly. */
static const sqlite3_io_methods ovlMainMethods = {
    2,
    ovlClose,
    ovlRead,
    ovlWrite,
    ovlTruncate,
    ovlSync,
    ovlFileSize,
    ovlLock,
    ovlUnlock,
    ovlCheckReservedLock,
    ovlFileControl,
    ovlSectorSize,
    ovlDeviceCharacteristics,
    ovlShmMap,
    ovlShmLock,
    ovlShmBarrier,
    ovlShmUnmap,
    0,
    0,
};

/* ---------------------------------------------------------------- capped journal / WAL */

#define REALM(pf) (((OvlFile *)(pf))->pReal)
static int limClose(sqlite3_file *f) { return REALM(f)->pMethods->xClose(REALM(f)); }
static int limRead(sqlite3_file *f, void *b, int n, i64 o) {
  return REALM(f)->pMethods->xRead(REALM(f), b, n, o);
}
static int limWrite(sqlite3_file *f, const void *b, int n, i64 o) {
  if (o + n > ((OvlFile *)f)->maxBytes) return SQLITE_FULL;
  return REALM(f)->pMethods->xWrite(REALM(f), b, n, o);
}
static int limTruncate(sqlite3_file *f, i64 s) {
  return REALM(f)->pMethods->xTruncate(REALM(f), s);
}
static int limSync(sqlite3_file *f, int fl) { return REALM(f)->pMethods->xSync(REALM(f), fl); }
static int limFileSize(sqlite3_file *f, i64 *s) {
  return REALM(f)->pMethods->xFileSize(REALM(f), s);
}
static int limLock(sqlite3_file *f, int l) { return REALM(f)->pMethods->xLock(REALM(f), l); }
static int limUnlock(sqlite3_file *f, int l) { return REALM(f)->pMethods->xUnlock(REALM(f), l); }
static int limCheckReservedLock(sqlite3_file *f, int *r) {
  return REALM(f)->pMethods->xCheckReservedLock(REALM(f), r);
}
static int limFileControl(sqlite3_file *f, int op, void *a) {
  return REALM(f)->pMethods->xFileControl(REALM(f), op, a);
}
static int limSectorSize(sqlite3_file *f) { return REALM(f)->pMethods->xSectorSize(REALM(f)); }
static int limDeviceCharacteristics(sqlite3_file *f) {
  return REALM(f)->pMethods->xDeviceCharacteristics(REALM(f));
}
static int limShmMap(sqlite3_file *f, int i, int s, int e, void volatile **pp) {
  return REALM(f)->pMethods->xShmMap(REALM(f), i, s, e, pp);
}
static int limShmLock(sqlite3_file *f, int o, int n, int fl) {
  return REALM(f)->pMethods->xShmLock(REALM(f), o, n, fl);
}
static void limShmBarrier(sqlite3_file *f) { REALM(f)->pMethods->xShmBarrier(REALM(f)); }
static int limShmUnmap(sqlite3_file *f, int d) {
  return REALM(f)->pMethods->xShmUnmap(REALM(f), d);
}
static int limFetch(sqlite3_file *f, i64 o, int n, void **pp) {
  if (REALM(f)->pMethods->iVersion < 3) {
    *pp = 0;
    return SQLITE_OK;
  }
  return REALM(f)->pMethods->xFetch(REALM(f), o, n, pp);
}
static int limUnfetch(sqlite3_file *f, i64 o, void *pp) {
  if (REALM(f)->pMethods->iVersion < 3) return SQLITE_OK;
  return REALM(f)->pMethods->xUnfetch(REALM(f), o, pp);
}

static const sqlite3_io_methods ovlLimitedMethods = {
    3,
    limClose,
    limRead,
    limWrite,
    limTruncate,
    limSync,
    limFileSize,
    limLock,
    limUnlock,
    limCheckReservedLock,
    limFileControl,
    limSectorSize,
    limDeviceCharacteristics,
    limShmMap,
    limShmLock,
    limShmBarrier,
    limShmUnmap,
    limFetch,
    limUnfetch,
};

/* ---------------------------------------------------------------- the VFS */

static int ovlOpen(sqlite3_vfs *pVfs, sqlite3_filename zName, sqlite3_file *pFile, int flags,
                   int *pOutFlags) {
  sqlite3_vfs *pOrig = ORIG_VFS(pVfs);
  OvlFile *p = (OvlFile *)pFile;
  int outFlags = 0, rc;

  if (!(flags & SQLITE_OPEN_MAIN_DB) || !zName) {
    i64 lim = 0;
    if (zName && (flags & (SQLITE_OPEN_MAIN_JOURNAL | SQLITE_OPEN_WAL)))
      lim = sqlite3_uri_int64(zName, "maxbytes", 0); /* the main db's parameters */
    if (lim <= 0) return pOrig->xOpen(pOrig, zName, pFile, flags, pOutFlags); /* plain */
    memset(p, 0, sizeof(*p));
    p->pReal = (sqlite3_file *)&p[1];
    p->pVfs = pVfs;
    p->maxBytes = lim;
    p->baseFd = p->ovlFd = -1;
    rc = pOrig->xOpen(pOrig, zName, p->pReal, flags, pOutFlags);
    if (rc) {
      pFile->pMethods = 0;
      return rc;
    }
    pFile->pMethods = &ovlLimitedMethods;
    return SQLITE_OK;
  }

  memset(p, 0, sizeof(*p));
  p->pReal = (sqlite3_file *)&p[1];
  p->pVfs = pVfs;
  p->baseFd = p->ovlFd = -1;
  pFile->pMethods = 0;
  const char *zBase = sqlite3_uri_parameter(zName, "base");
  if (!zBase || !*zBase) return SQLITE_CANTOPEN; /* never a silent plain file */
  p->maxBytes = sqlite3_uri_int64(zName, "maxbytes", 0);
  if (p->maxBytes < 0) p->maxBytes = 0;
  if (baseAcquire(zBase, &p->baseFd, &p->baseSize) != SQLITE_OK) return SQLITE_CANTOPEN;
  rc = pOrig->xOpen(pOrig, zName, p->pReal, flags, &outFlags);
  if (rc) {
    p->pReal->pMethods = 0;
    goto fail;
  }
  p->readOnly = (outFlags & SQLITE_OPEN_READONLY) != 0;
  p->zOvl = sqlite3_mprintf("%s-ovl", zName);
  if (!p->zOvl) {
    rc = SQLITE_NOMEM;
    goto fail;
  }
  do {
    p->ovlFd = p->readOnly ? open(p->zOvl, O_RDONLY | O_CLOEXEC)
                           : open(p->zOvl, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  } while (p->ovlFd < 0 && errno == EINTR);
  if (p->ovlFd < 0 && !(p->readOnly && errno == ENOENT)) {
    rc = SQLITE_CANTOPEN;
    goto fail;
  }
  p->gen = GEN_UNKNOWN;
  rc = ovlRefresh(p, 1);
  if (rc) {
    rc = SQLITE_CANTOPEN; /* unreadable side file or a base of another size */
    goto fail;
  }
  pFile->pMethods = &ovlMainMethods;
  if (pOutFlags) *pOutFlags = outFlags;
  return SQLITE_OK;
fail:
  ovlClose(pFile);
  pFile->pMethods = 0;
  return rc;
}

static int ovlDelete(sqlite3_vfs *v, const char *z, int sync) {
  return ORIG_VFS(v)->xDelete(ORIG_VFS(v), z, sync);
}
static int ovlAccess(sqlite3_vfs *v, const char *z, int f, int *r) {
  return ORIG_VFS(v)->xAccess(ORIG_VFS(v), z, f, r);
}
static int ovlFullPathname(sqlite3_vfs *v, const char *z, int n, char *out) {
  return ORIG_VFS(v)->xFullPathname(ORIG_VFS(v), z, n, out);
}
static void *ovlDlOpen(sqlite3_vfs *v, const char *z) {
  return ORIG_VFS(v)->xDlOpen(ORIG_VFS(v), z);
}
static void ovlDlError(sqlite3_vfs *v, int n, char *z) { ORIG_VFS(v)->xDlError(ORIG_VFS(v), n, z); }
static void (*ovlDlSym(sqlite3_vfs *v, void *h, const char *z))(void) {
  return ORIG_VFS(v)->xDlSym(ORIG_VFS(v), h, z);
}
static void ovlDlClose(sqlite3_vfs *v, void *h) { ORIG_VFS(v)->xDlClose(ORIG_VFS(v), h); }
static int ovlRandomness(sqlite3_vfs *v, int n, char *z) {
  return ORIG_VFS(v)->xRandomness(ORIG_VFS(v), n, z);
}
static int ovlSleep(sqlite3_vfs *v, int us) { return ORIG_VFS(v)->xSleep(ORIG_VFS(v), us); }
static int ovlCurrentTime(sqlite3_vfs *v, double *t) {
  return ORIG_VFS(v)->xCurrentTime(ORIG_VFS(v), t);
}
static int ovlGetLastError(sqlite3_vfs *v, int n, char *z) {
  return ORIG_VFS(v)->xGetLastError ? ORIG_VFS(v)->xGetLastError(ORIG_VFS(v), n, z) : 0;
}
static int ovlCurrentTimeInt64(sqlite3_vfs *v, sqlite3_int64 *t) {
  sqlite3_vfs *o = ORIG_VFS(v);
  if (o->iVersion >= 2 && o->xCurrentTimeInt64) return o->xCurrentTimeInt64(o, t);
  double d;
  int rc = o->xCurrentTime(o, &d);
  *t = (sqlite3_int64)(d * 86400000.0);
  return rc;
}
static int ovlSetSystemCall(sqlite3_vfs *v, const char *z, sqlite3_syscall_ptr f) {
  sqlite3_vfs *o = ORIG_VFS(v);
  return o->iVersion >= 3 && o->xSetSystemCall ? o->xSetSystemCall(o, z, f) : SQLITE_NOTFOUND;
}
static sqlite3_syscall_ptr ovlGetSystemCall(sqlite3_vfs *v, const char *z) {
  sqlite3_vfs *o = ORIG_VFS(v);
  return o->iVersion >= 3 && o->xGetSystemCall ? o->xGetSystemCall(o, z) : 0;
}
static const char *ovlNextSystemCall(sqlite3_vfs *v, const char *z) {
  sqlite3_vfs *o = ORIG_VFS(v);
  return o->iVersion >= 3 && o->xNextSystemCall ? o->xNextSystemCall(o, z) : 0;
}

/* Register a VFS called zName over the current default VFS; idempotent. */
static int ovlRegister(const char *zName) {
  sqlite3_vfs *existing = sqlite3_vfs_find(zName);
  if (existing) return existing->xOpen == ovlOpen ? SQLITE_OK : SQLITE_ERROR;
  sqlite3_vfs *pOrig = sqlite3_vfs_find(0);
  if (!pOrig) return SQLITE_ERROR;
  sqlite3_vfs *v = calloc(1, sizeof(*v));
  char *name = strdup(zName);
  if (!v || !name) {
    free(v);
    free(name);
    return SQLITE_NOMEM;
  }
  v->iVersion = 3;
  v->szOsFile = (int)((sizeof(OvlFile) + 15) / 16 * 16) + pOrig->szOsFile;
  v->mxPathname = pOrig->mxPathname;
  v->zName = name;
  v->pAppData = pOrig;
  v->xOpen = ovlOpen;
  v->xDelete = ovlDelete;
  v->xAccess = ovlAccess;
  v->xFullPathname = ovlFullPathname;
  v->xDlOpen = ovlDlOpen;
  v->xDlError = ovlDlError;
  v->xDlSym = ovlDlSym;
  v->xDlClose = ovlDlClose;
  v->xRandomness = ovlRandomness;
  v->xSleep = ovlSleep;
  v->xCurrentTime = ovlCurrentTime;
  v->xGetLastError = ovlGetLastError;
  v->xCurrentTimeInt64 = ovlCurrentTimeInt64;
  v->xSetSystemCall = ovlSetSystemCall;
  v->xGetSystemCall = ovlGetSystemCall;
  v->xNextSystemCall = ovlNextSystemCall;
  int rc = sqlite3_vfs_register(v, 0);
  if (rc) { /* v is not in the list: safe to free */
    free(name);
    free(v);
    return rc;
  }
  pthread_atfork(baseAtforkPrepare, baseAtforkRelease, baseAtforkRelease);
  return SQLITE_OK; /* v lives as long as the process */
}

/* ---------------------------------------------------------------- self test (fuzz) */

static uint64_t xorshift(uint64_t *s) {
  uint64_t x = *s;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return *s = x;
}

typedef struct {
  uint8_t *d;
  i64 n, cap;
} Mirror;

static int mirrorResize(Mirror *m, i64 n) {
  if (n > m->cap) {
    i64 c = imax(n, m->cap * 2);
    uint8_t *d = realloc(m->d, (size_t)c);
    if (!d) return -1;
    m->d = d;
    m->cap = c;
  }
  if (n > m->n) memset(m->d + m->n, 0, (size_t)(n - m->n));
  m->n = n;
  return 0;
}

/* Random xWrite/xRead/xTruncate against an in-memory mirror, with reopen and a second handle
 * that must see every change after taking a lock. Returns NULL or an error message. */
static const char *selftest(const char *zVfs, const char *zSess, const char *zBase, uint64_t seed,
                            long steps, char *msg, size_t msglen) {
  sqlite3_vfs *v = sqlite3_vfs_find(zVfs);
  if (!v || v->xOpen != ovlOpen) return "vfs not registered";
  const char *params[2] = {"base", zBase};
  sqlite3_filename fn = sqlite3_create_filename(zSess, "", "", 1, params);
  sqlite3_file *a = calloc(1, (size_t)v->szOsFile), *b = calloc(1, (size_t)v->szOsFile);
  uint8_t *buf = malloc(1 << 16), *exp = malloc(1 << 16);
  Mirror m = {0, 0, 0};
  const char *err = NULL;
  int flags = SQLITE_OPEN_MAIN_DB | SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, out, rc;
  uint64_t s = seed ? seed : 88172645463325252ULL;
  if (!fn || !a || !b || !buf || !exp) {
    err = "out of memory";
    goto done;
  }
  {
    int fd = open(zBase, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) || mirrorResize(&m, st.st_size) ||
        readFull(fd, m.d, st.st_size, 0) != st.st_size) {
      if (fd >= 0) close(fd);
      err = "cannot read base";
      goto done;
    }
    close(fd);
  }
#define FAIL(...)                          \
  do {                                     \
    snprintf(msg, msglen, __VA_ARGS__);    \
    err = msg;                             \
    goto done;                             \
  } while (0)
  if ((rc = v->xOpen(v, fn, a, flags, &out)) != SQLITE_OK) FAIL("open a: rc=%d", rc);
  a->pMethods->xLock(a, SQLITE_LOCK_SHARED);
  a->pMethods->xLock(a, SQLITE_LOCK_EXCLUSIVE);
  for (long step = 0; step < steps; step++) {
    uint64_t r = xorshift(&s);
    int op = (int)(r % 10);
    i64 sz;
    a->pMethods->xFileSize(a, &sz);
    if (sz != m.n) FAIL("step %ld: size %lld, expected %lld", step, (long long)sz, (long long)m.n);
    if (op < 4) { /* write */
      i64 off, n;
      if (xorshift(&s) & 1) { /* page-aligned like SQLite */
        n = (i64)1 << (9 + xorshift(&s) % 4);
        off = (i64)(xorshift(&s) % (uint64_t)((m.n + 3 * n) / n + 1)) * n;
      } else {
        n = 1 + (i64)(xorshift(&s) % (3 * OVL_BLK));
        off = (i64)(xorshift(&s) % (uint64_t)(m.n + 2 * OVL_BLK + 1));
      }
      int kind = (int)(xorshift(&s) % 4);
      for (i64 i = 0; i < n; i++) {
        if (kind == 0) buf[i] = 0;
        else if (kind == 1) buf[i] = off + i < m.n ? m.d[off + i] : 0; /* same as the view */
        else buf[i] = (uint8_t)xorshift(&s);
      }
      if ((rc = a->pMethods->xWrite(a, buf, (int)n, off)) != SQLITE_OK)
        FAIL("step %ld: write rc=%d", step, rc);
      if (off + n > m.n && mirrorResize(&m, off + n)) FAIL("oom");
      memcpy(m.d + off, buf, (size_t)n);
    } else if (op < 7) { /* read */
      i64 off = (i64)(xorshift(&s) % (uint64_t)(m.n + OVL_BLK + 1));
      i64 n = 1 + (i64)(xorshift(&s) % (4 * OVL_BLK));
      rc = a->pMethods->xRead(a, buf, (int)n, off);
      memset(exp, 0, (size_t)n);
      if (off < m.n) memcpy(exp, m.d + off, (size_t)imin(n, m.n - off));
      int wantRc = off + n > m.n ? SQLITE_IOERR_SHORT_READ : SQLITE_OK;
      if (rc != wantRc || memcmp(buf, exp, (size_t)n))
        FAIL("step %ld: read off=%lld n=%lld rc=%d mismatch", step, (long long)off,
             (long long)n, rc);
    } else if (op < 8) { /* truncate, mostly shrinking */
      i64 n = (i64)(xorshift(&s) % (uint64_t)(m.n + 2 * OVL_BLK + 1));
      if (xorshift(&s) & 1) n = n / OVL_BLK * OVL_BLK;
      if ((rc = a->pMethods->xTruncate(a, n)) != SQLITE_OK) FAIL("step %ld: truncate rc=%d", step, rc);
      if (n < m.n) m.n = n;
      else if (mirrorResize(&m, n)) FAIL("oom");
    } else if (op < 9) { /* a second handle must see everything once it takes a lock */
      a->pMethods->xUnlock(a, SQLITE_LOCK_NONE);
      if ((rc = v->xOpen(v, fn, b, flags, &out)) != SQLITE_OK) FAIL("open b: rc=%d", rc);
      b->pMethods->xLock(b, SQLITE_LOCK_SHARED);
      b->pMethods->xFileSize(b, &sz);
      uint8_t *all = malloc((size_t)imax(sz, 1));
      rc = all ? b->pMethods->xRead(b, all, (int)sz, 0) : SQLITE_NOMEM;
      int bad = sz != m.n || (sz > 0 && rc != SQLITE_OK) || (sz > 0 && memcmp(all, m.d, (size_t)sz));
      free(all);
      b->pMethods->xUnlock(b, SQLITE_LOCK_NONE);
      b->pMethods->xClose(b);
      if (bad) FAIL("step %ld: second handle sees size %lld (want %lld) rc=%d or other bytes",
                    step, (long long)sz, (long long)m.n, rc);
      a->pMethods->xLock(a, SQLITE_LOCK_SHARED);
      a->pMethods->xLock(a, SQLITE_LOCK_EXCLUSIVE);
    } else { /* close and reopen */
      a->pMethods->xUnlock(a, SQLITE_LOCK_NONE);
      a->pMethods->xClose(a);
      if ((rc = v->xOpen(v, fn, a, flags, &out)) != SQLITE_OK) {
        a->pMethods = 0;
        FAIL("reopen a: rc=%d", rc);
      }
      a->pMethods->xLock(a, SQLITE_LOCK_SHARED);
      a->pMethods->xLock(a, SQLITE_LOCK_EXCLUSIVE);
    }
  }
#undef FAIL
done:
  if (a && a->pMethods) {
    a->pMethods->xUnlock(a, SQLITE_LOCK_NONE);
    a->pMethods->xClose(a);
  }
  free(a);
  free(b);
  free(buf);
  free(exp);
  free(m.d);
  sqlite3_free_filename(fn);
  return err;
}

/* ---------------------------------------------------------------- Python module */

static PyObject *py_register(PyObject *self, PyObject *args) {
  const char *name;
  if (!PyArg_ParseTuple(args, "s:register", &name)) return NULL;
  int rc = ovlRegister(name);
  if (rc == SQLITE_ERROR) {
    PyErr_Format(PyExc_RuntimeError, "a different SQLite VFS named %s is already registered", name);
    return NULL;
  }
  if (rc) {
    PyErr_Format(PyExc_RuntimeError, "sqlite3_vfs_register(%s) failed: %s", name,
                 sqlite3_errstr(rc));
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *py_libversion(PyObject *self, PyObject *noargs) {
  return PyUnicode_FromString(sqlite3_libversion());
}

static PyObject *py_selftest(PyObject *self, PyObject *args) {
  const char *vfs, *sess, *base;
  unsigned long long seed;
  long steps;
  char msg[256];
  const char *err;
  if (!PyArg_ParseTuple(args, "sssKl:_selftest", &vfs, &sess, &base, &seed, &steps)) return NULL;
  Py_BEGIN_ALLOW_THREADS err = selftest(vfs, sess, base, seed, steps, msg, sizeof msg);
  Py_END_ALLOW_THREADS if (err) {
    PyErr_SetString(PyExc_AssertionError, err);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"register", py_register, METH_VARARGS,
     "register(name) -> None: register the overlay VFS under name (idempotent, never default)."},
    {"libversion", py_libversion, METH_NOARGS,
     "libversion() -> str: sqlite3_libversion() of the library this module is linked against."},
    {"_selftest", py_selftest, METH_VARARGS,
     "_selftest(vfs, session_path, base_path, seed, steps): fuzz the VFS file methods against an "
     "in-memory mirror; raises AssertionError on the first difference."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_overlay",
    "Copy-on-write page-overlay SQLite VFS (see birdenv.replicas.overlay).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__overlay(void) {
  PyObject *m = PyModule_Create(&moduledef);
  if (m && PyModule_AddIntConstant(m, "BLOCK_SIZE", OVL_BLK) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
