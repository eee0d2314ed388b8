"""The library's parts: ``seeding`` (a checkpoint read once and served), ``download`` (a host's copy as it
fills), ``copies`` (where a copy lives and what the cache remembers of it), ``handshake`` (addresses, HELLO,
STATUS).  ``p2pweights.api`` is the surface users import; these are its rooms."""
