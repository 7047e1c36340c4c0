/*
 * overlay_selftest.c: the fuzz self-test: random writes, truncations and reopenings in both
 * modes, checked against an in-memory mirror (run by tests/test_overlay_fuzz.py).
 *
 * Part of the overlay VFS: compiled as part of overlay.c, after overlay.h and the parts before it.
 */

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
