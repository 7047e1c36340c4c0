/*
 * birdenv.replicas.native._overlay: a copy-on-write page-overlay SQLite VFS.
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
 *  - No global mutable state except the registered sqlite3_vfs structs, the table of shared
 *    base descriptors (under its own mutex): every session of a process on the same base reads
 *    it through one read-only descriptor, so a session costs no descriptor for its base; and the
 *    registry of shared-pages sessions and their page stores (under another).
 *
 * A session opened with `pages=<prefix>` keeps no private page file and no side file: its changed
 * pages live in a content-addressed page store shared by the process's sessions on the same base,
 * and its map of them in this process's memory (see "shared pages" below). Its file P then only
 * carries its locks, and a marker P-shared says that its state lives in its owner's process.
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
#include <sys/mman.h>
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
  struct ShState *sh;   /* shared-pages sessions: the session's state (else NULL) */
  i64 mmapLimit;        /* SQLite's mmap_size: base pages below it may be read in place */
  const uint8_t *map;   /* the base's read-only map (see baseMap), once a fetch asked for it */
  i64 mapLen;
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
  int mapTried;     /* a map was asked for (and is in map, unless mmap failed) */
  uint8_t *map;     /* the whole file, read-only, shared by every session on it */
  i64 mapLen;
  struct BaseRef *next;
} BaseRef;

static BaseRef *baseRefs;
static pthread_mutex_t baseMutex = PTHREAD_MUTEX_INITIALIZER;


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
  r->mapTried = 0;
  r->map = NULL;
  r->mapLen = 0;
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
    if (r->map) munmap(r->map, (size_t)r->mapLen);
    close(r->fd);
    free(r);
  }
  pthread_mutex_unlock(&baseMutex);
}

/* The read-only map of the whole base open as fd, made on first use and shared like the
 * descriptor (it lives until the descriptor's last session closes, after SQLite has let go of
 * every page it fetched), or NULL when it cannot be mapped: reads then go through xRead. A base
 * never changes, so its map never needs remapping. */
static const uint8_t *baseMap(int fd, i64 *pLen) {
  BaseRef *r;
  struct stat st;
  pthread_mutex_lock(&baseMutex);
  for (r = baseRefs; r && r->fd != fd; r = r->next) {
  }
  if (r && !r->mapTried) {
    r->mapTried = 1;
    if (fstat(fd, &st) == 0 && st.st_size > 0) {
      void *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
      if (m != MAP_FAILED) {
        r->map = m;
        r->mapLen = st.st_size;
      }
    }
  }
  const uint8_t *map = r ? r->map : NULL;
  *pLen = r ? r->mapLen : 0;
  pthread_mutex_unlock(&baseMutex);
  return map;
}

/* Whether SQLite may read iAmt bytes at iOfst in place from the base map, as far as the limit it
 * set, the alignment and the map itself tell (the caller checks which blocks the session changed). */
static int fetchable(OvlFile *p, int baseFd, i64 iOfst, int iAmt) {
  if (p->mmapLimit <= 0 || iOfst + iAmt > p->mmapLimit || iOfst % OVL_BLK || iAmt % OVL_BLK ||
      iAmt <= 0)
    return 0;
  if (!p->map && p->mapLen == 0 && !(p->map = baseMap(baseFd, &p->mapLen))) p->mapLen = -1;
  return p->map && iOfst + iAmt <= p->mapLen;
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
    case SQLITE_FCNTL_MMAP_SIZE: { /* the limit for ovlFetch; P itself is never mapped */
      const i64 limit = *(i64 *)pArg;
      *(i64 *)pArg = p->mmapLimit;
      if (limit >= 0) p->mmapLimit = limit;
      return SQLITE_OK;
    }
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

/* Version 3: SQLite may read a page in place (PRAGMA mmap_size) when every block of it still
 * shows the base: a pointer into the base's shared map, which never changes. A page the session
 * changed, or one past the base limit, is read through xRead. SQLite fetches only while it holds a
 * read lock, under which the bitmap is current, and it never writes through a fetched page. */
static int ovlFetch(sqlite3_file *pFile, i64 iOfst, int iAmt, void **pp) {
  OvlFile *p = (OvlFile *)pFile;
  *pp = NULL;
  if (iOfst + iAmt > p->size || iOfst + iAmt > p->baseLimit ||
      !fetchable(p, p->baseFd, iOfst, iAmt))
    return SQLITE_OK;
  for (i64 b = iOfst / OVL_BLK; b < (iOfst + iAmt) / OVL_BLK; b++)
    if (testBit(p, b)) return SQLITE_OK;
  *pp = (void *)(p->map + iOfst);
  return SQLITE_OK;
}

/* Nothing to release: the map outlives every fetched page (see baseMap). */
static int ovlUnfetch(sqlite3_file *pFile, i64 iOfst, void *pPage) { return SQLITE_OK; }

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

/* SQLite never memory-maps P itself: its fetches come to ovlFetch. */
static const sqlite3_io_methods ovlMainMethods = {
    3,
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
    ovlFetch,
    ovlUnfetch,
};

/* ---------------------------------------------------------------- shared pages: the store
 *
 * A session opened with a `pages=<prefix>` URI parameter keeps no private page file: every block
 * it changes lives in a content-addressed page store shared by all such sessions of this process
 * on the same base. A write of one SQLite page (a power of two from 512 to 65536 bytes, aligned
 * to its size) is one unit; any other write is split into 512-byte units. A unit equal to what
 * the base shows at its place is not stored at all. Otherwise it is hashed; a unit with the same
 * hash is compared byte for byte, and only an identical one is shared. Each unit size has its own
 * store file, `<prefix>-<size>`, of slots of that size.
 *
 * Invariant: a slot is written once, when it is allocated, and never again while any block maps
 * to it (its reference count is the number of mapped blocks, over all sessions). When the count
 * drops to zero the slot leaves the content index and goes on a free list, to be reused for new
 * content; free slots give their disk back in batches (storeTrim). The last session's release
 * closes and unlinks the store files.
 */

#define NCLASS 8            /* unit sizes OVL_BLK << c, c = 0..7: 512 .. 65536 bytes */
#define GRP 8               /* blocks per entry of a session's map */
#define LOC_IDX_BITS 29     /* a location: (class << 29 | 512-byte index in the class file) + 1 */
#define LOC_MAX_IDX ((((uint32_t)1) << LOC_IDX_BITS) - 2)
#define STACK_LOCS 256

static uint32_t locMake(int cls, i64 idx) { return (((uint32_t)cls << LOC_IDX_BITS) | (uint32_t)idx) + 1; }
static int locClass(uint32_t loc) { return (int)((loc - 1) >> LOC_IDX_BITS); }
static i64 locIndex(uint32_t loc) { return (i64)((loc - 1) & ((((uint32_t)1) << LOC_IDX_BITS) - 1)); }

typedef struct PgClass {
  int fd;            /* the class's store file, -1 until first used */
  i64 unit;          /* bytes per slot */
  i64 nSlots, cap;   /* slots in the file (live or free); capacity of refs/hashes */
  uint32_t *refs;    /* per slot: blocks mapped to it, over all sessions */
  uint64_t *hashes;  /* per slot: content hash, valid while refs > 0 */
  i64 *freeSlots;     /* reused last in, first out; [0, nClean) have had their disk punched out */
  i64 nFree, capFree, nClean;
  uint64_t *idxHash; /* content index, open addressing: hash -> slot + 1 (0: empty) */
  uint32_t *idxSlot;
  i64 idxCap, idxLen;
} PgClass;

typedef struct PgStore {
  struct PgStore *next;
  char *zPrefix;
  int baseFd;
  dev_t baseDev;
  ino_t baseIno;
  i64 baseSize;
  int nStates; /* session states attached */
  pid_t owner; /* the process whose store this is; a forked child inherits a copy of it */
  pthread_mutex_t mu;
  PgClass cls[NCLASS];
  uint64_t nPuts, nShared; /* units stored, and those that found an identical stored unit */
  i64 nUnits, nBytes, nRefs; /* live slots, their bytes, and the blocks mapped to them */
  i64 dirtyBytes;            /* free slots whose disk has not been given back yet */
  i64 trimFloor;             /* ... given back past max(this, a quarter of the live bytes) */
} PgStore;

typedef struct ShGroup {
  i64 key; /* block / GRP, or -1 when the entry is empty */
  uint32_t loc[GRP];
} ShGroup;

/* One session's view, shared by every connection of this process to it. */
typedef struct ShState {
  struct ShState *next;
  char *zPath, *zMarker;
  dev_t markerDev;
  ino_t markerIno;
  PgStore *store;
  pthread_mutex_t mu;
  int nRef; /* open files, plus one while registered (findable by path) */
  i64 size, baseLimit, nMapped;
  ShGroup *groups; /* open addressing on key */
  i64 gCap, gLen;
} ShState;

/* The registry: guarded by gMu, which is never taken while a state or store lock is held. A forked
 * child inherits a copy of it, and of the store files' descriptors: it must neither use nor free
 * what it inherited (freeing would punch holes in its parent's pages), see inherited(). */
static pthread_mutex_t gMu = PTHREAD_MUTEX_INITIALIZER;
static PgStore *gStores;
static ShState *gStates;

/* A child forked while another thread held one of the global mutexes (this one, or the base
 * descriptors') must not inherit it locked. Neither is ever taken while the other is held. */
static void atforkPrepare(void) {
  pthread_mutex_lock(&baseMutex);
  pthread_mutex_lock(&gMu);
}
static void atforkRelease(void) {
  pthread_mutex_unlock(&gMu);
  pthread_mutex_unlock(&baseMutex);
}

static int inherited(const PgStore *s) { return s->owner != getpid(); }

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static uint64_t load64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

/* 64-bit hash of n bytes, n a multiple of 32: four independent multiply-rotate lanes (so the CPU
 * overlaps them) and a final avalanche. It only picks candidates; equality is always checked on
 * the bytes, so its quality bounds the speed of a lookup, never its correctness. */
static uint64_t pageHash(const uint8_t *p, i64 n) {
  const uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL, P3 = 0x165667B19E3779F9ULL;
  uint64_t a = P1 + P2 + (uint64_t)n, b = P2, c = (uint64_t)n, d = P3 - P1;
  for (i64 i = 0; i < n; i += 32) {
    a = rotl64(a + load64(p + i) * P2, 31) * P1;
    b = rotl64(b + load64(p + i + 8) * P2, 31) * P1;
    c = rotl64(c + load64(p + i + 16) * P2, 31) * P1;
    d = rotl64(d + load64(p + i + 24) * P2, 31) * P1;
  }
  uint64_t h = rotl64(a, 1) + rotl64(b, 7) + rotl64(c, 12) + rotl64(d, 18);
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

/* -- the content index of a class (linear probing, backward-shift deletion) */

static int idxGrow(PgClass *c) {
  i64 ncap = c->idxCap ? c->idxCap * 2 : 256;
  uint64_t *nh = sqlite3_malloc64((sqlite3_uint64)ncap * sizeof(uint64_t));
  uint32_t *ns = sqlite3_malloc64((sqlite3_uint64)ncap * sizeof(uint32_t));
  if (!nh || !ns) {
    sqlite3_free(nh);
    sqlite3_free(ns);
    return SQLITE_NOMEM;
  }
  memset(ns, 0, (size_t)ncap * sizeof(uint32_t));
  for (i64 i = 0; i < c->idxCap; i++) {
    if (!c->idxSlot[i]) continue;
    i64 j = (i64)(c->idxHash[i] & (uint64_t)(ncap - 1));
    while (ns[j]) j = (j + 1) & (ncap - 1);
    nh[j] = c->idxHash[i];
    ns[j] = c->idxSlot[i];
  }
  sqlite3_free(c->idxHash);
  sqlite3_free(c->idxSlot);
  c->idxHash = nh;
  c->idxSlot = ns;
  c->idxCap = ncap;
  return SQLITE_OK;
}

static void idxRemove(PgClass *c, uint64_t h, i64 slot) {
  const i64 mask = c->idxCap - 1;
  i64 i = (i64)(h & (uint64_t)mask);
  while (c->idxSlot[i] && !(c->idxHash[i] == h && c->idxSlot[i] == (uint32_t)(slot + 1)))
    i = (i + 1) & mask;
  if (!c->idxSlot[i]) return; /* not indexed: cannot happen, and harmless */
  for (i64 j = (i + 1) & mask; c->idxSlot[j]; j = (j + 1) & mask) {
    i64 home = (i64)(c->idxHash[j] & (uint64_t)mask);
    /* entry j may move into the hole at i if its home is not in the cyclic range (i, j] */
    int inRange = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (!inRange) {
      c->idxHash[i] = c->idxHash[j];
      c->idxSlot[i] = c->idxSlot[j];
      i = j;
    }
  }
  c->idxSlot[i] = 0;
  c->idxLen--;
}

/* -- slots */

static int classOpen(PgStore *s, int k) {
  PgClass *c = &s->cls[k];
  if (c->fd >= 0) return SQLITE_OK;
  char *z = sqlite3_mprintf("%s-%lld", s->zPrefix, (long long)c->unit);
  if (!z) return SQLITE_NOMEM;
  do {
    c->fd = open(z, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (c->fd < 0 && errno == EINTR);
  sqlite3_free(z);
  return c->fd < 0 ? SQLITE_CANTOPEN : SQLITE_OK;
}

/* Drop n references to the slot holding loc; a slot nobody maps is freed. Store lock held. */
static void slotRelease(PgStore *s, uint32_t loc, uint32_t n) {
  PgClass *c = &s->cls[locClass(loc)];
  i64 slot = locIndex(loc) / (c->unit / OVL_BLK);
  s->nRefs -= n;
  if (c->refs[slot] > n) {
    c->refs[slot] -= n;
    return;
  }
  c->refs[slot] = 0;
  s->nUnits--;
  s->nBytes -= c->unit;
  idxRemove(c, c->hashes[slot], slot);
  if (c->nFree == c->capFree) {
    i64 ncap = c->capFree ? c->capFree * 2 : 64;
    i64 *nf = sqlite3_realloc64(c->freeSlots, (sqlite3_uint64)ncap * sizeof(i64));
    if (!nf) return; /* the slot stays unused: a leak of one slot, never a wrong page */
    c->freeSlots = nf;
    c->capFree = ncap;
  }
  c->freeSlots[c->nFree++] = slot;
  s->dirtyBytes += c->unit;
}

static int cmpSlot(const void *a, const void *b) {
  const i64 x = *(const i64 *)a, y = *(const i64 *)b;
  return x < y ? -1 : x > y;
}

/* Give the disk of free slots back once they outweigh a quarter of the live ones (and 1 MiB),
 * one hole per run of adjacent slots: a hole per slot costs more than the reset it follows. A
 * failure only costs space (a free slot's content is never read again). Store lock held. */
static void storeTrim(PgStore *s) {
  if (s->dirtyBytes <= imax(s->nBytes / 4, s->trimFloor)) return;
  for (int k = 0; k < NCLASS; k++) {
    PgClass *c = &s->cls[k];
    i64 *dirty = c->freeSlots + c->nClean, n = c->nFree - c->nClean;
    qsort(dirty, (size_t)n, sizeof *dirty, cmpSlot);
    for (i64 i = 0, j; i < n; i = j) {
      for (j = i + 1; j < n && dirty[j] == dirty[j - 1] + 1; j++) {
      }
#ifdef FALLOC_FL_PUNCH_HOLE
      (void)fallocate(c->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(dirty[i] * c->unit),
                      (off_t)((dirty[j - 1] - dirty[i] + 1) * c->unit));
#endif
    }
    c->nClean = c->nFree;
  }
  s->dirtyBytes = 0;
}

/* Store the unit `data` of class k (or find an identical stored one) and take `refs` references
 * to it; *pLoc receives the location of its first block. Store lock held. */
static int slotPut(PgStore *s, int k, const uint8_t *data, uint32_t refs, uint8_t *scratch,
                   uint32_t *pLoc) {
  PgClass *c = &s->cls[k];
  const i64 per = c->unit / OVL_BLK;
  int rc = classOpen(s, k);
  if (rc) return rc;
  const uint64_t h = pageHash(data, c->unit);
  s->nPuts++;
  if (c->idxCap) {
    for (i64 i = (i64)(h & (uint64_t)(c->idxCap - 1)); c->idxSlot[i]; i = (i + 1) & (c->idxCap - 1)) {
      if (c->idxHash[i] != h) continue;
      const i64 slot = (i64)c->idxSlot[i] - 1;
      if (readFull(c->fd, scratch, c->unit, slot * c->unit) != c->unit) return SQLITE_IOERR_READ;
      if (memcmp(scratch, data, (size_t)c->unit) != 0) continue; /* a hash collision */
      c->refs[slot] += refs;
      s->nRefs += refs;
      s->nShared++;
      *pLoc = locMake(k, slot * per);
      return SQLITE_OK;
    }
  }
  if ((c->idxLen + 1) * 2 > c->idxCap && (rc = idxGrow(c)) != SQLITE_OK) return rc;
  i64 slot;
  const int reused = c->nFree > 0;
  if (reused) {
    slot = c->freeSlots[--c->nFree];
    if (c->nFree < c->nClean) c->nClean = c->nFree;
    else s->dirtyBytes -= c->unit;
  } else {
    if ((c->nSlots + 1) * per - 1 > (i64)LOC_MAX_IDX) return SQLITE_FULL;
    if (c->nSlots == c->cap) {
      i64 ncap = c->cap ? c->cap * 2 : 256;
      uint32_t *nr = sqlite3_realloc64(c->refs, (sqlite3_uint64)ncap * sizeof(uint32_t));
      if (!nr) return SQLITE_NOMEM;
      c->refs = nr;
      uint64_t *nh = sqlite3_realloc64(c->hashes, (sqlite3_uint64)ncap * sizeof(uint64_t));
      if (!nh) return SQLITE_NOMEM;
      c->hashes = nh;
      c->cap = ncap;
    }
    slot = c->nSlots++;
  }
  if (writeFull(c->fd, data, c->unit, slot * c->unit)) {
    rc = errWrite(errno);
    if (reused) { /* back on the free list, where it just was (now counted dirty) */
      c->nFree++;
      s->dirtyBytes += c->unit;
    }
    else c->nSlots--;
    return rc;
  }
  c->refs[slot] = refs;
  c->hashes[slot] = h;
  s->nRefs += refs;
  s->nUnits++;
  s->nBytes += c->unit;
  i64 i = (i64)(h & (uint64_t)(c->idxCap - 1));
  while (c->idxSlot[i]) i = (i + 1) & (c->idxCap - 1);
  c->idxHash[i] = h;
  c->idxSlot[i] = (uint32_t)(slot + 1);
  c->idxLen++;
  *pLoc = locMake(k, slot * per);
  return SQLITE_OK;
}

static void storeFree(PgStore *s) {
  for (int k = 0; k < NCLASS; k++) {
    PgClass *c = &s->cls[k];
    if (c->fd >= 0) close(c->fd);
    sqlite3_free(c->refs);
    sqlite3_free(c->hashes);
    sqlite3_free(c->freeSlots);
    sqlite3_free(c->idxHash);
    sqlite3_free(c->idxSlot);
  }
  if (s->baseFd >= 0) baseRelease(s->baseFd);
  pthread_mutex_destroy(&s->mu);
  sqlite3_free(s->zPrefix);
  sqlite3_free(s);
}

/* -- a session's map: block -> location (0: not mapped, the base or zeros show) */

static ShGroup *grpFind(const ShState *st, i64 key) {
  if (!st->gCap) return NULL;
  const i64 mask = st->gCap - 1;
  for (i64 i = (i64)(((uint64_t)key * 0x9E3779B97F4A7C15ULL) >> 17) & mask;; i = (i + 1) & mask) {
    if (st->groups[i].key == key) return &st->groups[i];
    if (st->groups[i].key < 0) return NULL;
  }
}

static uint32_t mapGet(const ShState *st, i64 blk) {
  const ShGroup *g = grpFind(st, blk / GRP);
  return g ? g->loc[blk % GRP] : 0;
}

static i64 grpHome(const ShState *st, i64 key) {
  return (i64)(((uint64_t)key * 0x9E3779B97F4A7C15ULL) >> 17) & (st->gCap - 1);
}

/* Make room for `more` new entries so that mapSet can never fail on memory. */
static int mapReserve(ShState *st, i64 more) {
  if ((st->gLen + more) * 2 <= st->gCap) return SQLITE_OK;
  i64 ncap = st->gCap ? st->gCap : 16;
  while ((st->gLen + more) * 2 > ncap) ncap *= 2;
  ShGroup *ng = sqlite3_malloc64((sqlite3_uint64)ncap * sizeof(ShGroup));
  if (!ng) return SQLITE_NOMEM;
  for (i64 i = 0; i < ncap; i++) ng[i].key = -1;
  ShGroup *old = st->groups;
  i64 oldCap = st->gCap;
  st->groups = ng;
  st->gCap = ncap;
  for (i64 i = 0; i < oldCap; i++) {
    if (old[i].key < 0) continue;
    i64 j = grpHome(st, old[i].key);
    while (ng[j].key >= 0) j = (j + 1) & (ncap - 1);
    ng[j] = old[i];
  }
  sqlite3_free(old);
  return SQLITE_OK;
}

static void grpDelete(ShState *st, ShGroup *g) {
  const i64 mask = st->gCap - 1;
  i64 i = g - st->groups;
  for (i64 j = (i + 1) & mask; st->groups[j].key >= 0; j = (j + 1) & mask) {
    i64 home = grpHome(st, st->groups[j].key);
    int inRange = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (!inRange) {
      st->groups[i] = st->groups[j];
      i = j;
    }
  }
  st->groups[i].key = -1;
  st->gLen--;
}

/* Set the location of blk; returns the previous one. Room for a new entry must be reserved. */
static uint32_t mapSet(ShState *st, i64 blk, uint32_t loc) {
  const i64 key = blk / GRP;
  ShGroup *g = grpFind(st, key);
  if (!g) {
    if (!loc) return 0;
    i64 i = grpHome(st, key);
    while (st->groups[i].key >= 0) i = (i + 1) & (st->gCap - 1);
    g = &st->groups[i];
    g->key = key;
    memset(g->loc, 0, sizeof g->loc);
    st->gLen++;
  }
  uint32_t old = g->loc[blk % GRP];
  g->loc[blk % GRP] = loc;
  st->nMapped += (loc != 0) - (old != 0);
  if (!loc) {
    int empty = 1;
    for (int i = 0; i < GRP && empty; i++) empty = g->loc[i] == 0;
    if (empty) grpDelete(st, g);
  }
  return old;
}

/* -- the registry */

/* Free a state nobody references any more, and its store with the last state on it. */
static void stateFree(ShState *st) {
  PgStore *s = st->store;
  pthread_mutex_lock(&s->mu);
  for (i64 i = 0; i < st->gCap; i++) {
    if (st->groups[i].key < 0) continue;
    for (int j = 0; j < GRP; j++)
      if (st->groups[i].loc[j]) slotRelease(s, st->groups[i].loc[j], 1);
  }
  storeTrim(s);
  pthread_mutex_unlock(&s->mu);
  pthread_mutex_lock(&gMu);
  if (--s->nStates == 0) {
    PgStore **pp = &gStores;
    while (*pp && *pp != s) pp = &(*pp)->next;
    if (*pp) *pp = s->next;
    /* unlinked under gMu, so that a new store of the same prefix never loses its files */
    for (int k = 0; k < NCLASS; k++) {
      if (s->cls[k].fd < 0) continue;
      char *z = sqlite3_mprintf("%s-%lld", s->zPrefix, (long long)s->cls[k].unit);
      if (z) unlink(z);
      sqlite3_free(z);
    }
  } else {
    s = NULL;
  }
  pthread_mutex_unlock(&gMu);
  if (s) storeFree(s);
  pthread_mutex_destroy(&st->mu);
  sqlite3_free(st->groups);
  sqlite3_free(st->zPath);
  sqlite3_free(st->zMarker);
  sqlite3_free(st);
}

/* Drop one reference (gMu not held); the last one frees the state and its pages. */
static void stateUnref(ShState *st) {
  if (inherited(st->store)) return; /* the parent's: kept, unused */
  pthread_mutex_lock(&gMu);
  const int last = --st->nRef == 0;
  pthread_mutex_unlock(&gMu);
  if (last) stateFree(st);
}

/* Take the state out of the registry (gMu held); returns it if that dropped its last reference. */
static ShState *stateUnregister(ShState *st) {
  ShState **pp = &gStates;
  while (*pp && *pp != st) pp = &(*pp)->next;
  if (*pp) *pp = st->next;
  return --st->nRef == 0 ? st : NULL;
}

/* Forget the session at zPath: its pages are released once no connection uses it. */
static int shRelease(const char *zPath) {
  ShState *dead = NULL, *st;
  pthread_mutex_lock(&gMu);
  for (st = gStates; st; st = st->next)
    if (strcmp(st->zPath, zPath) == 0 && !inherited(st->store)) break;
  if (st) dead = stateUnregister(st);
  pthread_mutex_unlock(&gMu);
  if (dead) stateFree(dead);
  return st != NULL;
}

/* A new store of shared pages for the base open as baseFd (gMu held; takes the reference). */
static PgStore *storeNew(const char *zPages, int baseFd, const struct stat *bst) {
  PgStore *s = sqlite3_malloc(sizeof(*s));
  if (!s) return NULL;
  memset(s, 0, sizeof(*s));
  if (!(s->zPrefix = sqlite3_mprintf("%s", zPages))) {
    sqlite3_free(s);
    return NULL;
  }
  s->baseFd = baseFd;
  s->baseDev = bst->st_dev;
  s->baseIno = bst->st_ino;
  s->baseSize = bst->st_size;
  s->owner = getpid();
  s->trimFloor = (i64)1 << 20;
  pthread_mutex_init(&s->mu, NULL);
  for (int k = 0; k < NCLASS; k++) {
    s->cls[k].fd = -1;
    s->cls[k].unit = (i64)OVL_BLK << k;
  }
  s->next = gStores;
  gStores = s;
  return s;
}

/* The state of the session zPath on the store zPages, over the base open as baseFd (whose
 * reference from baseAcquire this takes). A new session must have no private pages and no owner: its marker
 * file P-shared is created exclusively, so another process (or one that used the session without
 * shared pages) cannot open it. */
static int shAttach(const char *zPath, const char *zPages, int baseFd, const struct stat *bst,
                    ShState **ppOut) {
  ShState *stale = NULL, *st;
  PgStore *s;
  struct stat mst, pst;
  int rc = SQLITE_CANTOPEN, mfd = -1;
  char *zMarker = sqlite3_mprintf("%s-shared", zPath);
  char *zOvl = sqlite3_mprintf("%s-ovl", zPath);
  char *zCopy = sqlite3_mprintf("%s", zPath);
  *ppOut = NULL;
  if (!zMarker || !zOvl || !zCopy) {
    rc = SQLITE_NOMEM;
    goto out;
  }
  pthread_mutex_lock(&gMu);
  for (st = gStates; st; st = st->next)
    if (strcmp(st->zPath, zPath) == 0 && !inherited(st->store)) break;
  if (st && (stat(zMarker, &mst) != 0 || mst.st_dev != st->markerDev || mst.st_ino != st->markerIno)) {
    stale = stateUnregister(st); /* its files were deleted without a release: a fresh session */
    st = NULL;
  }
  if (st) {
    if (strcmp(st->store->zPrefix, zPages) == 0 && st->store->baseDev == bst->st_dev &&
        st->store->baseIno == bst->st_ino) {
      st->nRef++;
      *ppOut = st;
      rc = SQLITE_OK;
    }
    goto unlock;
  }
  if (stat(zOvl, &pst) == 0 || (stat(zPath, &pst) == 0 && pst.st_size > 0)) goto unlock;
  for (s = gStores; s; s = s->next)
    if (strcmp(s->zPrefix, zPages) == 0 && !inherited(s)) break;
  if (s && (s->baseDev != bst->st_dev || s->baseIno != bst->st_ino || s->baseSize != bst->st_size))
    goto unlock; /* one store, one base */
  do {
    mfd = open(zMarker, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  } while (mfd < 0 && errno == EINTR);
  if (mfd < 0) goto unlock;
  if (fstat(mfd, &mst) != 0 || !(st = sqlite3_malloc(sizeof(*st)))) {
    unlink(zMarker);
    goto unlock;
  }
  memset(st, 0, sizeof(*st));
  if (!s) {
    if (!(s = storeNew(zPages, baseFd, bst))) {
      sqlite3_free(st);
      unlink(zMarker);
      rc = SQLITE_NOMEM;
      goto unlock;
    }
    baseFd = -1; /* the new store keeps this reference */
  }
  s->nStates++;
  st->store = s;
  st->zPath = zCopy;
  st->zMarker = zMarker;
  zCopy = zMarker = NULL;
  st->markerDev = mst.st_dev;
  st->markerIno = mst.st_ino;
  st->size = st->baseLimit = bst->st_size;
  st->nRef = 2; /* the registry's and the caller's */
  pthread_mutex_init(&st->mu, NULL);
  st->next = gStates;
  gStates = st;
  *ppOut = st;
  rc = SQLITE_OK;
unlock:
  pthread_mutex_unlock(&gMu);
out:
  if (mfd >= 0) close(mfd);
  if (stale) stateFree(stale);
  if (baseFd >= 0) baseRelease(baseFd);
  sqlite3_free(zMarker);
  sqlite3_free(zOvl);
  sqlite3_free(zCopy);
  return rc;
}

/* ---------------------------------------------------------------- shared pages: io methods */

/* Fill buf with the logical bytes [off, off+n) of a session (zeros past its end), and say how
 * long the file is in *pSize. The caller holds the state lock when `locked`. */
static int shReadView(OvlFile *p, uint8_t *buf, i64 off, i64 n, int locked, i64 *pSize) {
  ShState *st = p->sh;
  PgStore *s = st->store;
  const i64 b0 = off / OVL_BLK, b1 = (off + n + OVL_BLK - 1) / OVL_BLK;
  uint32_t stackLocs[STACK_LOCS], *locs = stackLocs;
  if (b1 - b0 > STACK_LOCS && !(locs = sqlite3_malloc64((sqlite3_uint64)(b1 - b0) * 4)))
    return SQLITE_NOMEM;
  /* The locations are copied under the lock and read after it: SQLite's own locks keep every
   * block a reader uses from being remapped meanwhile, and a mapped slot is never rewritten. */
  if (!locked) pthread_mutex_lock(&st->mu);
  const i64 size = st->size, baseLimit = st->baseLimit;
  const ShGroup *g = NULL;
  for (i64 b = b0; b < b1; b++) {
    if (b == b0 || b % GRP == 0) g = st->gLen ? grpFind(st, b / GRP) : NULL; /* once a group */
    locs[b - b0] = g ? g->loc[b % GRP] : 0;
  }
  if (!locked) pthread_mutex_unlock(&st->mu);
  if (pSize) *pSize = size;
  int rc = SQLITE_OK;
  const i64 end = off + n;
  for (i64 pos = off, segEnd; pos < end && rc == SQLITE_OK; pos = segEnd) {
    const i64 b = pos / OVL_BLK;
    const uint32_t loc = locs[b - b0];
    uint8_t *dst = buf + (pos - off);
    if (pos >= size) {
      memset(dst, 0, (size_t)(end - pos));
      break;
    }
    /* one source for the run of blocks that continues it: the same store file at the next
     * place, or more unmapped base blocks, or more zeros */
    const i64 limit = loc ? size : pos < baseLimit ? baseLimit : size;
    segEnd = imin(imin(end, (b + 1) * OVL_BLK), limit);
    while (segEnd < end && segEnd < limit) {
      const uint32_t next = locs[segEnd / OVL_BLK - b0];
      if (loc ? next != loc + (uint32_t)(segEnd / OVL_BLK - b) : next != 0) break;
      segEnd = imin(imin(end, segEnd + OVL_BLK), limit);
    }
    i64 got = segEnd - pos;
    if (loc)
      got = readFull(s->cls[locClass(loc)].fd, dst, segEnd - pos,
                     locIndex(loc) * OVL_BLK + (pos - b * OVL_BLK));
    else if (pos < baseLimit)
      got = readFull(s->baseFd, dst, segEnd - pos, pos);
    else
      memset(dst, 0, (size_t)(segEnd - pos));
    if (got < 0) rc = SQLITE_IOERR_READ;
    else if (got < segEnd - pos) memset(dst + got, 0, (size_t)(segEnd - pos - got));
  }
  if (locs != stackLocs) sqlite3_free(locs);
  return rc;
}

static int shRead(sqlite3_file *pFile, void *zBuf, int iAmt, i64 iOfst) {
  i64 size;
  int rc = shReadView((OvlFile *)pFile, zBuf, iOfst, iAmt, 0, &size); /* zeros past the end */
  return rc == SQLITE_OK && iOfst + iAmt > size ? SQLITE_IOERR_SHORT_READ : rc;
}

/* Does data, n bytes at pos, equal what the base shows there (its bytes below the base limit,
 * zeros above)? */
static int shEqualsBase(const PgStore *s, i64 baseLimit, const uint8_t *data, i64 pos, i64 n,
                        uint8_t *scratch, int *pEq) {
  const i64 inBase = imax(imin(pos + n, baseLimit) - pos, 0);
  if (inBase > 0) {
    i64 got = readFull(s->baseFd, scratch, inBase, pos);
    if (got < 0) return SQLITE_IOERR_READ;
    if (got < inBase) memset(scratch + got, 0, (size_t)(inBase - got));
    if (memcmp(scratch, data, (size_t)inBase) != 0) {
      *pEq = 0;
      return SQLITE_OK;
    }
  }
  *pEq = isZero(data + inBase, n - inBase);
  return SQLITE_OK;
}

/* Map the nb blocks from block b0 on to the content in data: one unit of class k covering them
 * all when k >= 0, else one 512-byte unit each. All or nothing. State lock held. */
static int shMapUnits(OvlFile *p, const uint8_t *data, i64 b0, i64 nb, int k) {
  ShState *st = p->sh;
  PgStore *s = st->store;
  const i64 per = k >= 0 ? nb : 1, nUnits = nb / per, unitBytes = per * OVL_BLK;
  uint32_t stackLocs[STACK_LOCS], *locs = stackLocs;
  uint8_t stackNeed[STACK_LOCS], *need = stackNeed; /* 1: differs from the base, so stored */
  uint8_t *scratch = sqlite3_malloc64((sqlite3_uint64)unitBytes);
  i64 u, newlyMapped = 0, stored = 0;
  int rc = SQLITE_OK;
  if (nUnits > STACK_LOCS) {
    locs = sqlite3_malloc64((sqlite3_uint64)nUnits * sizeof(uint32_t));
    need = sqlite3_malloc64((sqlite3_uint64)nUnits);
  }
  if (!scratch || !locs || !need) {
    rc = SQLITE_NOMEM;
    goto out;
  }
  for (u = 0; u < nUnits && rc == SQLITE_OK; u++) {
    int eq = 0;
    rc = shEqualsBase(s, st->baseLimit, data + u * unitBytes, (b0 + u * per) * OVL_BLK, unitBytes,
                      scratch, &eq);
    need[u] = !eq;
    locs[u] = 0;
    for (i64 j = 0; j < per && need[u]; j++) newlyMapped += !st->gLen || !mapGet(st, b0 + u * per + j);
  }
  if (rc) goto out;
  /* the cap counts the blocks a session maps, shared or not, so it trips where it would alone */
  if (p->maxBytes > 0 && newlyMapped > 0 && (st->nMapped + newlyMapped) * OVL_BLK > p->maxBytes) {
    rc = SQLITE_FULL;
    goto out;
  }
  if ((rc = mapReserve(st, (nb + GRP - 1) / GRP + 1)) != SQLITE_OK) goto out;
  pthread_mutex_lock(&s->mu);
  for (u = 0; u < nUnits && rc == SQLITE_OK; u++) {
    if (!need[u]) continue;
    rc = slotPut(s, k >= 0 ? k : 0, data + u * unitBytes, (uint32_t)per, scratch, &locs[u]);
    stored += rc == SQLITE_OK;
  }
  if (rc) { /* undo: the view stays as it was */
    for (u = 0; u < nUnits && stored > 0; u++) {
      if (!locs[u]) continue;
      slotRelease(s, locs[u], (uint32_t)per);
      stored--;
    }
  } else {
    /* point the blocks at the units first, then let go of what they pointed at: a rewrite of
     * identical content keeps its slot alive throughout */
    for (u = 0; u < nUnits; u++)
      for (i64 j = 0; j < per; j++) {
        const uint32_t old = mapSet(st, b0 + u * per + j, locs[u] ? locs[u] + (uint32_t)j : 0);
        if (old) slotRelease(s, old, 1);
      }
    storeTrim(s);
  }
  pthread_mutex_unlock(&s->mu);
out:
  if (locs != stackLocs) sqlite3_free(locs);
  if (need != stackNeed) sqlite3_free(need);
  sqlite3_free(scratch);
  return rc;
}

static int shWrite(sqlite3_file *pFile, const void *zBuf, int iAmt, i64 iOfst) {
  OvlFile *p = (OvlFile *)pFile;
  ShState *st = p->sh;
  if (p->readOnly) return SQLITE_READONLY;
  if (inherited(st->store)) return SQLITE_IOERR_WRITE;
  if (iAmt <= 0) return SQLITE_OK;
  const i64 S = iOfst / OVL_BLK * OVL_BLK;
  const i64 E = (iOfst + iAmt + OVL_BLK - 1) / OVL_BLK * OVL_BLK;
  const uint8_t *data = zBuf;
  uint8_t *tmp = NULL;
  int rc = SQLITE_OK, k = -1;
  pthread_mutex_lock(&st->mu);
  if (S != iOfst || E != iOfst + iAmt) {
    /* partial blocks: compose whole blocks from the current view (never happens for pages) */
    if (!(tmp = sqlite3_malloc64((sqlite3_uint64)(E - S)))) rc = SQLITE_NOMEM;
    else rc = shReadView(p, tmp, S, E - S, 1, NULL);
    if (rc == SQLITE_OK) memcpy(tmp + (iOfst - S), zBuf, (size_t)iAmt);
    data = tmp;
  } else if ((iAmt & (iAmt - 1)) == 0 && iOfst % iAmt == 0) {
    for (int c = 0; c < NCLASS; c++)
      if (((i64)OVL_BLK << c) == iAmt) k = c; /* one SQLite page: one unit */
  }
  if (rc == SQLITE_OK) rc = shMapUnits(p, data, S / OVL_BLK, (E - S) / OVL_BLK, k);
  if (rc == SQLITE_OK && iOfst + iAmt > st->size) st->size = iOfst + iAmt;
  pthread_mutex_unlock(&st->mu);
  sqlite3_free(tmp);
  return rc;
}

static int shTruncate(sqlite3_file *pFile, i64 size) {
  OvlFile *p = (OvlFile *)pFile;
  ShState *st = p->sh;
  PgStore *s = st->store;
  int rc = SQLITE_OK;
  if (p->readOnly) return SQLITE_READONLY;
  if (inherited(s)) return SQLITE_IOERR_TRUNCATE;
  if (size < 0) size = 0;
  pthread_mutex_lock(&st->mu);
  if (size < st->size) {
    const i64 newNb = nblocks(size), oldNb = nblocks(st->size);
    if (size % OVL_BLK && st->gLen && mapGet(st, size / OVL_BLK)) {
      /* a stored unit keeps the bytes past the new end: map a copy of the last block with zeros
       * there, so that they read as zeros if the file grows again */
      uint8_t blk[OVL_BLK];
      const i64 at = size / OVL_BLK * OVL_BLK;
      rc = shReadView(p, blk, at, OVL_BLK, 1, NULL);
      if (rc == SQLITE_OK) {
        memset(blk + (size - at), 0, (size_t)(OVL_BLK - (size - at)));
        rc = shMapUnits(p, blk, at / OVL_BLK, 1, -1);
      }
    }
    if (rc == SQLITE_OK && st->gLen) {
      pthread_mutex_lock(&s->mu);
      if (oldNb - newNb <= st->gLen * GRP) {
        for (i64 b = newNb; b < oldNb; b++)
          if (mapGet(st, b)) slotRelease(s, mapSet(st, b, 0), 1);
      } else { /* fewer map entries than blocks cut: walk the map instead */
        for (i64 i = 0; i < st->gCap; i++) {
          /* unmapping may delete entry i and shift a later one into its place: look again */
          for (int j = 0; st->groups[i].key >= 0 && j < GRP;) {
            const i64 blk = st->groups[i].key * GRP + j;
            if (blk >= newNb && st->groups[i].loc[j]) {
              slotRelease(s, mapSet(st, blk, 0), 1);
              j = 0;
            } else {
              j++;
            }
          }
        }
      }
      storeTrim(s);
      pthread_mutex_unlock(&s->mu);
    }
    if (rc == SQLITE_OK && st->baseLimit > size) st->baseLimit = size; /* gone for good */
  }
  if (rc == SQLITE_OK) st->size = size;
  pthread_mutex_unlock(&st->mu);
  return rc;
}

/* The session's state lives in this process (and its pages in the store): nothing to flush. */
static int shSync(sqlite3_file *pFile, int flags) {
  (void)pFile;
  (void)flags;
  return SQLITE_OK;
}

static int shFileSize(sqlite3_file *pFile, i64 *pSize) {
  ShState *st = ((OvlFile *)pFile)->sh;
  pthread_mutex_lock(&st->mu);
  *pSize = st->size;
  pthread_mutex_unlock(&st->mu);
  return SQLITE_OK;
}

static int shLock(sqlite3_file *pFile, int level) {
  OvlFile *p = (OvlFile *)pFile;
  return p->pReal->pMethods->xLock(p->pReal, level);
}

static int shUnlock(sqlite3_file *pFile, int level) {
  OvlFile *p = (OvlFile *)pFile;
  return p->pReal->pMethods->xUnlock(p->pReal, level);
}

static int shShmLock(sqlite3_file *pFile, int offset, int n, int flags) {
  OvlFile *p = (OvlFile *)pFile;
  return p->pReal->pMethods->xShmLock(p->pReal, offset, n, flags);
}

static int shClose(sqlite3_file *pFile) {
  OvlFile *p = (OvlFile *)pFile;
  int rc = SQLITE_OK;
  if (p->pReal->pMethods) rc = p->pReal->pMethods->xClose(p->pReal);
  if (p->sh) stateUnref(p->sh);
  p->sh = NULL;
  return rc;
}

/* ovlFetch for a session whose changed pages are shared: a page maps in place when none of its
 * blocks is mapped to the store and it lies below the base limit. */
static int shFetch(sqlite3_file *pFile, i64 iOfst, int iAmt, void **pp) {
  OvlFile *p = (OvlFile *)pFile;
  ShState *st = p->sh;
  *pp = NULL;
  if (!fetchable(p, st->store->baseFd, iOfst, iAmt)) return SQLITE_OK;
  pthread_mutex_lock(&st->mu);
  int ok = iOfst + iAmt <= st->size && iOfst + iAmt <= st->baseLimit;
  const ShGroup *g = NULL;
  for (i64 b = iOfst / OVL_BLK; ok && b < (iOfst + iAmt) / OVL_BLK; b++) {
    if (b == iOfst / OVL_BLK || b % GRP == 0) g = st->gLen ? grpFind(st, b / GRP) : NULL;
    ok = !g || g->loc[b % GRP] == 0;
  }
  pthread_mutex_unlock(&st->mu);
  if (ok) *pp = (void *)(p->map + iOfst);
  return SQLITE_OK;
}

/* Locks, shared memory, file controls and device characteristics are the private overlay's: both
 * delegate them to P. */
static const sqlite3_io_methods ovlSharedMethods = {
    3,
    shClose,
    shRead,
    shWrite,
    shTruncate,
    shSync,
    shFileSize,
    shLock,
    shUnlock,
    ovlCheckReservedLock,
    ovlFileControl,
    ovlSectorSize,
    ovlDeviceCharacteristics,
    ovlShmMap,
    shShmLock,
    ovlShmBarrier,
    ovlShmUnmap,
    shFetch,
    ovlUnfetch,
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
  const char *zPages = sqlite3_uri_parameter(zName, "pages");
  if (zPages && *zPages) {
    struct stat bst;
    if (fstat(p->baseFd, &bst) != 0) {
      rc = SQLITE_CANTOPEN;
      goto fail;
    }
    const int baseFd = p->baseFd;
    p->baseFd = -1; /* shAttach takes this reference to it */
    rc = shAttach(zName, zPages, baseFd, &bst, &p->sh);
    if (rc) goto fail;
    pFile->pMethods = &ovlSharedMethods;
    if (pOutFlags) *pOutFlags = outFlags;
    return SQLITE_OK;
  }
  p->zOvl = sqlite3_mprintf("%s-ovl", zName);
  char *zMarker = sqlite3_mprintf("%s-shared", zName);
  if (!p->zOvl || !zMarker) {
    sqlite3_free(zMarker);
    rc = SQLITE_NOMEM;
    goto fail;
  }
  /* a session whose pages are shared lives in its owner's memory: its files alone mean nothing */
  const int shared = access(zMarker, F_OK) == 0;
  sqlite3_free(zMarker);
  if (shared) {
    rc = SQLITE_CANTOPEN;
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
  pthread_atfork(atforkPrepare, atforkRelease, atforkRelease);
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

/* Every file a session may leave, for the self test's discards. */
static void unlinkSession(const char *zPath) {
  static const char *suffixes[] = {"-ovl", "-shared", "-journal", "-wal", "-shm", ""};
  for (size_t i = 0; i < sizeof suffixes / sizeof *suffixes; i++) {
    char *z = sqlite3_mprintf("%s%s", zPath, suffixes[i]);
    if (z) unlink(z);
    sqlite3_free(z);
  }
}

/* Store invariants: the references of live slots add up to the blocks the sessions map, and
 * every live slot is indexed once. NULL when they hold. */
static const char *storeCheck(const char *zPages, i64 mappedBySessions) {
  const char *err = NULL;
  pthread_mutex_lock(&gMu);
  PgStore *s = gStores;
  while (s && strcmp(s->zPrefix, zPages) != 0) s = s->next;
  if (s) {
    pthread_mutex_lock(&s->mu);
    i64 refs = 0, units = 0, bytes = 0, indexed = 0;
    for (int k = 0; k < NCLASS && !err; k++) {
      const PgClass *c = &s->cls[k];
      for (i64 i = 0; i < c->nSlots; i++) {
        refs += c->refs[i];
        units += c->refs[i] > 0;
        bytes += c->refs[i] > 0 ? c->unit : 0;
      }
      for (i64 i = 0; i < c->idxCap; i++) indexed += c->idxSlot[i] != 0;
      if (c->nSlots - c->nFree < 0 || c->nClean > c->nFree) err = "free list counters are off";
    }
    if (!err && (refs != s->nRefs || refs != mappedBySessions)) err = "slot references do not add up";
    if (!err && (units != s->nUnits || bytes != s->nBytes)) err = "live slot counters are off";
    if (!err && indexed != units) err = "the content index does not hold exactly the live slots";
    pthread_mutex_unlock(&s->mu);
  } else if (mappedBySessions) {
    err = "mapped blocks but no store";
  }
  pthread_mutex_unlock(&gMu);
  return err;
}

static i64 mappedBlocks(const char *zPath) {
  i64 n = 0;
  pthread_mutex_lock(&gMu);
  for (ShState *st = gStates; st; st = st->next)
    if (strcmp(st->zPath, zPath) == 0) n = st->nMapped;
  pthread_mutex_unlock(&gMu);
  return n;
}

typedef struct {
  char *zPath;
  sqlite3_filename fn;
  sqlite3_file *f; /* open, holding an exclusive lock */
  Mirror m;
} Twin;

static int twinOpen(sqlite3_vfs *v, Twin *t) {
  int out, rc = v->xOpen(v, t->fn, t->f, SQLITE_OPEN_MAIN_DB | SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, &out);
  if (rc) {
    t->f->pMethods = 0;
    return rc;
  }
  t->f->pMethods->xLock(t->f, SQLITE_LOCK_SHARED);
  t->f->pMethods->xLock(t->f, SQLITE_LOCK_EXCLUSIVE);
  i64 limit = (i64)1 << 40; /* what PRAGMA mmap_size sets: fetches in place are allowed */
  t->f->pMethods->xFileControl(t->f, SQLITE_FCNTL_MMAP_SIZE, &limit);
  return SQLITE_OK;
}

static void twinClose(Twin *t) {
  if (!t->f || !t->f->pMethods) return;
  t->f->pMethods->xUnlock(t->f, SQLITE_LOCK_NONE);
  t->f->pMethods->xClose(t->f);
  t->f->pMethods = 0;
}

/* Random xWrite/xRead/xTruncate on two sessions over one base (sharing a page store when zPages
 * is set), each against an in-memory mirror, with reopens, discards and a second handle that must
 * see every change after taking a lock. Writes often copy the other session's bytes or the base's,
 * so that pages are shared and unshared. Returns NULL or an error message. */
static const char *selftest(const char *zVfs, const char *zSess, const char *zBase,
                            const char *zPages, uint64_t seed, long steps, char *msg, size_t msglen) {
  sqlite3_vfs *v = sqlite3_vfs_find(zVfs);
  if (!v || v->xOpen != ovlOpen) return "vfs not registered";
  const int share = zPages && *zPages;
  const char *params[4] = {"base", zBase, "pages", zPages};
  Twin tw[2];
  memset(tw, 0, sizeof tw);
  sqlite3_file *b = calloc(1, (size_t)v->szOsFile);
  uint8_t *buf = malloc(1 << 17), *exp = malloc(1 << 17);
  Mirror base = {0, 0, 0};
  const char *err = NULL;
  long fetched = 0; /* pages read in place */
  int rc;
  uint64_t s = seed ? seed : 88172645463325252ULL;
#define FAIL(...)                       \
  do {                                  \
    snprintf(msg, msglen, __VA_ARGS__); \
    err = msg;                          \
    goto done;                          \
  } while (0)
  if (!b || !buf || !exp) FAIL("out of memory");
  {
    int fd = open(zBase, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) || mirrorResize(&base, st.st_size) ||
        readFull(fd, base.d, st.st_size, 0) != st.st_size) {
      if (fd >= 0) close(fd);
      FAIL("cannot read base");
    }
    close(fd);
  }
  for (int i = 0; i < 2; i++) {
    tw[i].zPath = i ? sqlite3_mprintf("%s-twin", zSess) : sqlite3_mprintf("%s", zSess);
    tw[i].fn = tw[i].zPath ? sqlite3_create_filename(tw[i].zPath, "", "", share ? 2 : 1, params) : 0;
    tw[i].f = calloc(1, (size_t)v->szOsFile);
    if (!tw[i].fn || !tw[i].f || mirrorResize(&tw[i].m, base.n)) FAIL("out of memory");
    memcpy(tw[i].m.d, base.d, (size_t)base.n);
    if ((rc = twinOpen(v, &tw[i])) != SQLITE_OK) FAIL("open %d: rc=%d", i, rc);
  }
  if (share) { /* give free slots' disk back at every release, so that trimming is exercised */
    pthread_mutex_lock(&gMu);
    for (PgStore *st = gStores; st; st = st->next)
      if (strcmp(st->zPrefix, zPages) == 0) st->trimFloor = 0;
    pthread_mutex_unlock(&gMu);
  }
  for (long step = 0; step < steps; step++) {
    uint64_t r = xorshift(&s);
    Twin *a = &tw[(r >> 32) & 1], *o = &tw[1 - ((r >> 32) & 1)];
    Mirror *m = &a->m;
    int op = (int)(r % 12);
    i64 sz;
    a->f->pMethods->xFileSize(a->f, &sz);
    if (sz != m->n) FAIL("step %ld: size %lld, expected %lld", step, (long long)sz, (long long)m->n);
    if (op < 4) { /* write */
      i64 off, n;
      if (xorshift(&s) % 4) { /* page-aligned like SQLite */
        n = (i64)1 << (9 + xorshift(&s) % 8);
        off = (i64)(xorshift(&s) % (uint64_t)((m->n + 3 * n) / n + 1)) * n;
      } else {
        n = 1 + (i64)(xorshift(&s) % (3 * OVL_BLK));
        off = (i64)(xorshift(&s) % (uint64_t)(m->n + 2 * OVL_BLK + 1));
      }
      int kind = (int)(xorshift(&s) % 5);
      for (i64 i = 0; i < n; i++) {
        const i64 at = off + i;
        if (kind == 0) buf[i] = 0;
        else if (kind == 1) buf[i] = at < m->n ? m->d[at] : 0;              /* same as the view */
        else if (kind == 2) buf[i] = (uint8_t)xorshift(&s);
        else if (kind == 3) buf[i] = at < o->m.n ? o->m.d[at] : 0;          /* the twin's bytes */
        else buf[i] = at < base.n ? base.d[at] : 0;                         /* the base's bytes */
      }
      if ((rc = a->f->pMethods->xWrite(a->f, buf, (int)n, off)) != SQLITE_OK)
        FAIL("step %ld: write rc=%d", step, rc);
      if (off + n > m->n && mirrorResize(m, off + n)) FAIL("oom");
      memcpy(m->d + off, buf, (size_t)n);
    } else if (op == 6 && (xorshift(&s) & 1)) { /* fetch a page in place: never other bytes */
      const i64 n = (i64)1 << (9 + xorshift(&s) % 8);
      const i64 off = (i64)(xorshift(&s) % (uint64_t)((m->n + n) / n + 1)) * n;
      void *page = NULL;
      if ((rc = a->f->pMethods->xFetch(a->f, off, (int)n, &page)) != SQLITE_OK)
        FAIL("step %ld: fetch rc=%d", step, rc);
      if (page) {
        fetched++;
        if (off + n > m->n || memcmp(page, m->d + off, (size_t)n))
          FAIL("step %ld: fetch off=%lld n=%lld shows other bytes", step, (long long)off,
               (long long)n);
        a->f->pMethods->xUnfetch(a->f, off, page);
      }
    } else if (op < 7) { /* read */
      i64 off = (i64)(xorshift(&s) % (uint64_t)(m->n + OVL_BLK + 1));
      i64 n = 1 + (i64)(xorshift(&s) % (8 * OVL_BLK));
      rc = a->f->pMethods->xRead(a->f, buf, (int)n, off);
      memset(exp, 0, (size_t)n);
      if (off < m->n) memcpy(exp, m->d + off, (size_t)imin(n, m->n - off));
      int wantRc = off + n > m->n ? SQLITE_IOERR_SHORT_READ : SQLITE_OK;
      if (rc != wantRc || memcmp(buf, exp, (size_t)n))
        FAIL("step %ld: read off=%lld n=%lld rc=%d mismatch", step, (long long)off,
             (long long)n, rc);
    } else if (op < 8) { /* truncate, mostly shrinking */
      i64 n = (i64)(xorshift(&s) % (uint64_t)(m->n + 2 * OVL_BLK + 1));
      if (xorshift(&s) & 1) n = n / OVL_BLK * OVL_BLK;
      if ((rc = a->f->pMethods->xTruncate(a->f, n)) != SQLITE_OK) FAIL("step %ld: truncate rc=%d", step, rc);
      if (n < m->n) m->n = n;
      else if (mirrorResize(m, n)) FAIL("oom");
    } else if (op < 9) { /* a second handle must see everything once it takes a lock */
      int out;
      a->f->pMethods->xUnlock(a->f, SQLITE_LOCK_NONE);
      if ((rc = v->xOpen(v, a->fn, b, SQLITE_OPEN_MAIN_DB | SQLITE_OPEN_READWRITE, &out)) != SQLITE_OK)
        FAIL("open b: rc=%d", rc);
      b->pMethods->xLock(b, SQLITE_LOCK_SHARED);
      b->pMethods->xFileSize(b, &sz);
      uint8_t *all = malloc((size_t)imax(sz, 1));
      rc = all ? b->pMethods->xRead(b, all, (int)sz, 0) : SQLITE_NOMEM;
      int bad = sz != m->n || (sz > 0 && rc != SQLITE_OK) || (sz > 0 && memcmp(all, m->d, (size_t)sz));
      free(all);
      b->pMethods->xUnlock(b, SQLITE_LOCK_NONE);
      b->pMethods->xClose(b);
      if (bad) FAIL("step %ld: second handle sees size %lld (want %lld) rc=%d or other bytes",
                    step, (long long)sz, (long long)m->n, rc);
      a->f->pMethods->xLock(a->f, SQLITE_LOCK_SHARED);
      a->f->pMethods->xLock(a->f, SQLITE_LOCK_EXCLUSIVE);
    } else if (op < 10) { /* close and reopen */
      twinClose(a);
      if ((rc = twinOpen(v, a)) != SQLITE_OK) FAIL("step %ld: reopen rc=%d", step, rc);
    } else if (op < 11) { /* discard: the session is pristine again, its twin unchanged */
      twinClose(a);
      if (share) shRelease(a->zPath);
      unlinkSession(a->zPath);
      if (mirrorResize(m, 0) || mirrorResize(m, base.n)) FAIL("oom");
      memcpy(m->d, base.d, (size_t)base.n);
      if ((rc = twinOpen(v, a)) != SQLITE_OK) FAIL("step %ld: open after discard rc=%d", step, rc);
    } else { /* the twin, whole, and the store's books */
      o->f->pMethods->xFileSize(o->f, &sz);
      uint8_t *all = malloc((size_t)imax(sz, 1));
      rc = all ? o->f->pMethods->xRead(o->f, all, (int)sz, 0) : SQLITE_NOMEM;
      int bad = sz != o->m.n || (sz > 0 && rc != SQLITE_OK) || (sz > 0 && memcmp(all, o->m.d, (size_t)sz));
      free(all);
      if (bad) FAIL("step %ld: the twin changed", step);
      const char *e = share ? storeCheck(zPages, mappedBlocks(tw[0].zPath) + mappedBlocks(tw[1].zPath)) : NULL;
      if (e) FAIL("step %ld: %s", step, e);
    }
  }
  if (steps >= 1000 && base.n >= 4096 && !fetched) FAIL("no page was ever read in place");
  for (int i = 0; i < 2; i++) { /* reset both: the store and its files must be gone */
    twinClose(&tw[i]);
    if (share) shRelease(tw[i].zPath);
    unlinkSession(tw[i].zPath);
  }
  if (share) {
    const char *e = storeCheck(zPages, 0);
    if (e) FAIL("after the resets: %s", e);
    pthread_mutex_lock(&gMu);
    PgStore *left = gStores;
    while (left && strcmp(left->zPrefix, zPages) != 0) left = left->next;
    pthread_mutex_unlock(&gMu);
    if (left) FAIL("the store outlived its last session");
    for (int k = 0; k < NCLASS; k++) {
      char *z = sqlite3_mprintf("%s-%lld", zPages, (long long)OVL_BLK << k);
      int exists = z && access(z, F_OK) == 0;
      sqlite3_free(z);
      if (exists) FAIL("a store file outlived its last session");
    }
  }
#undef FAIL
done:
  for (int i = 0; i < 2; i++) {
    twinClose(&tw[i]);
    free(tw[i].f);
    free(tw[i].m.d);
    sqlite3_free_filename(tw[i].fn);
    sqlite3_free(tw[i].zPath);
  }
  free(b);
  free(buf);
  free(exp);
  free(base.d);
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
  const char *vfs, *sess, *base, *pages = "";
  unsigned long long seed;
  long steps;
  char msg[256];
  const char *err;
  if (!PyArg_ParseTuple(args, "sssKl|s:_selftest", &vfs, &sess, &base, &seed, &steps, &pages))
    return NULL;
  Py_BEGIN_ALLOW_THREADS err = selftest(vfs, sess, base, pages, seed, steps, msg, sizeof msg);
  Py_END_ALLOW_THREADS if (err) {
    PyErr_SetString(PyExc_AssertionError, err);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *py_release(PyObject *self, PyObject *args) {
  const char *path;
  int found;
  if (!PyArg_ParseTuple(args, "s:release", &path)) return NULL;
  Py_BEGIN_ALLOW_THREADS found = shRelease(path);
  Py_END_ALLOW_THREADS return PyBool_FromLong(found);
}

static PyObject *py_hold_base(PyObject *self, PyObject *args) {
  const char *path;
  int fd = -1, rc;
  i64 size;
  if (!PyArg_ParseTuple(args, "s:hold_base", &path)) return NULL;
  Py_BEGIN_ALLOW_THREADS errno = 0;
  rc = baseAcquire(path, &fd, &size);
  if (rc != SQLITE_OK && !errno) errno = EINVAL; /* there, but not a regular file */
  Py_END_ALLOW_THREADS if (rc != SQLITE_OK) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
  return PyLong_FromLong(fd);
}

static PyObject *py_release_base(PyObject *self, PyObject *args) {
  int fd;
  if (!PyArg_ParseTuple(args, "i:release_base", &fd)) return NULL;
  Py_BEGIN_ALLOW_THREADS baseRelease(fd);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

typedef struct {
  char *zPrefix;
  long long sessions, units, bytes, refs;
  unsigned long long puts, shared;
} StoreFigures;

static PyObject *py_page_stores(PyObject *self, PyObject *noargs) {
  /* copied out under the locks, turned into Python objects after: building them may run a
   * finalizer that closes a connection, which takes these locks */
  StoreFigures *fig = NULL;
  Py_ssize_t n = 0, i;
  int oom = 0;
  pthread_mutex_lock(&gMu);
  for (PgStore *s = gStores; s; s = s->next) n += !inherited(s);
  if (n && !(fig = calloc((size_t)n, sizeof *fig))) oom = 1;
  i = 0;
  for (PgStore *s = gStores; s && !oom; s = s->next) {
    if (inherited(s)) continue;
    pthread_mutex_lock(&s->mu);
    fig[i].zPrefix = strdup(s->zPrefix);
    fig[i].sessions = s->nStates;
    fig[i].units = s->nUnits;
    fig[i].bytes = s->nBytes;
    fig[i].refs = s->nRefs;
    fig[i].puts = s->nPuts;
    fig[i].shared = s->nShared;
    pthread_mutex_unlock(&s->mu);
    oom = !fig[i++].zPrefix;
  }
  pthread_mutex_unlock(&gMu);
  PyObject *out = oom ? NULL : PyList_New(0);
  for (i = 0; i < n && out; i++) {
    PyObject *d = Py_BuildValue(
        "{s:s,s:L,s:L,s:L,s:L,s:K,s:K}", "pages", fig[i].zPrefix, "sessions", fig[i].sessions,
        "units", fig[i].units, "stored_bytes", fig[i].bytes, "mapped_bytes",
        fig[i].refs * (long long)OVL_BLK, "writes", fig[i].puts, "shared_writes", fig[i].shared);
    if (!d || PyList_Append(out, d) < 0) Py_CLEAR(out);
    Py_XDECREF(d);
  }
  for (i = 0; i < n && fig; i++) free(fig[i].zPrefix);
  free(fig);
  if (oom) return PyErr_NoMemory();
  return out;
}

static PyObject *py_hash_cost(PyObject *self, PyObject *args) {
  long long unit, iterations;
  if (!PyArg_ParseTuple(args, "LL:_hash_cost", &unit, &iterations)) return NULL;
  if (unit < 32 || unit % 32 || unit > (1 << 20) || iterations < 1) {
    PyErr_SetString(PyExc_ValueError, "unit must be a multiple of 32 up to 1 MiB, iterations >= 1");
    return NULL;
  }
  uint8_t *buf = malloc((size_t)unit);
  if (!buf) return PyErr_NoMemory();
  uint64_t x = 0x2545F4914F6CDD1DULL, acc = 0;
  for (long long i = 0; i < unit; i++) buf[i] = (uint8_t)xorshift(&x);
  struct timespec t0, t1;
  Py_BEGIN_ALLOW_THREADS clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long long i = 0; i < iterations; i++) {
    buf[i % unit] ^= (uint8_t)i; /* a different page each time */
    acc ^= pageHash(buf, unit);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  Py_END_ALLOW_THREADS free(buf);
  volatile uint64_t sink = acc;
  (void)sink;
  return PyFloat_FromDouble(((double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9) /
                            (double)iterations);
}

static PyMethodDef methods[] = {
    {"register", py_register, METH_VARARGS,
     "register(name) -> None: register the overlay VFS under name (idempotent, never default)."},
    {"libversion", py_libversion, METH_NOARGS,
     "libversion() -> str: sqlite3_libversion() of the library this module is linked against."},
    {"release", py_release, METH_VARARGS,
     "release(path) -> bool: forget the shared-pages session at path (its real path), releasing "
     "its pages once no connection uses it; False when there was none."},
    {"hold_base", py_hold_base, METH_VARARGS,
     "hold_base(path) -> int: take a reference to this process's shared descriptor of the base "
     "at path (and to its map, once made); the int is for release_base."},
    {"release_base", py_release_base, METH_VARARGS,
     "release_base(handle) -> None: drop a reference taken by hold_base."},
    {"page_stores", py_page_stores, METH_NOARGS,
     "page_stores() -> list[dict]: figures of this process's shared page stores."},
    {"_selftest", py_selftest, METH_VARARGS,
     "_selftest(vfs, session_path, base_path, seed, steps, pages=''): fuzz the VFS file methods "
     "of two sessions (sharing a page store when pages is set) against in-memory mirrors; "
     "raises AssertionError on the first difference."},
    {"_hash_cost", py_hash_cost, METH_VARARGS,
     "_hash_cost(unit, iterations) -> float: seconds per content hash of a unit-byte page."},
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
