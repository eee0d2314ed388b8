"""The node: one process's event loop (``node``) and what it does I/O with: message handlers (``handlers``,
``pulled``), partner links and lanes (``partners``, ``lanes``), chunks in and out (``intake``, ``forward``),
the origin reader's thread (``originread``), the tracker link (``member``), the uplink probe (``uplink``), and
the standalone tracker's loop (``trackerd``)."""
