"""Pure pull and serve policy: what a peer asks of which partner and when (``pull``, ``pickrules``, ``help``,
``link``), and which asked-for chunk it sends to whom next (``serve``).  No sockets, files or threads."""
