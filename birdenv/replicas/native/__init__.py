"""The replica layer's C extensions, built by ``setup.py`` as optional.

``_overlay`` (``overlay.c``) is the copy-on-write page-overlay SQLite VFS that
:mod:`birdenv.replicas.overlay` loads; ``_sizes`` (``sizes.c``) counts a fetched batch's bytes
for :mod:`birdenv.replicas.session`. Without a C compiler neither is built: the pool copies
databases instead, and the session counts bytes with its Python rule.
"""
