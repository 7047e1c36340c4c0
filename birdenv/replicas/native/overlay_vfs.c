/*
 * overlay_vfs.c: the capped journal and WAL files, and the VFS itself: opening a session
 * in either mode, delegating the rest to the default VFS, and registering it.
 *
 * Part of the overlay VFS: compiled as part of overlay.c, after overlay.h and the parts before it.
 */

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
