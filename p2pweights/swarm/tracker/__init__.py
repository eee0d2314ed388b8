"""The tracker: membership, placement and partners (``tracker``, ``topology``, ``slotindex``), tickets and
admission (``membership``, ``admission``), the standalone tracker's swarms, candidates and origin shares
(``registry``, ``rootless``, ``shares``, ``publishers``), the fleet snapshot (``fleet``) and the seeder's
handlers over it all (``endpoint``).  Pure state with an injected clock; it never moves chunk bytes."""
