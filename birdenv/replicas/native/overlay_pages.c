/*
 * overlay_pages.c: shared-pages mode: the content-addressed page store that a process's
 * sessions on one base share, each session's map of its pages, and the I/O methods over them.
 *
 * Part of the overlay VFS: compiled as part of overlay.c, after overlay.h and the parts before it.
 */

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
