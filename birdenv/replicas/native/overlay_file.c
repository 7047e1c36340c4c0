/*
 * overlay_file.c: private-file mode: a session's own page file P and its side file P-ovl
 * (block bitmap and header), the view they give over the base, the base descriptors every session
 * on a base shares, and the main database's I/O methods.
 *
 * Part of the overlay VFS: compiled as part of overlay.c, after overlay.h and the parts before it.
 */

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
