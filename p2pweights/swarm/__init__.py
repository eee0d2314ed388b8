"""The swarm, in three rooms and the simulator beside them.

``policy/``: the pure rules a peer decides by (what to pull of whom, help, each link's window, whom to serve
next); no I/O.  ``tracker/``: membership and placement (the plan, partners, demotion), admission, tickets, the
registry of a standalone tracker and its origin shares; pure state with an injected clock, and the seeder's
endpoint over it.  ``node/``: the event loop and what does I/O around it (handlers, partner links and lanes,
forwarding, intake, the tracker link, the uplink probe, the standalone tracker's loop).  Imports flow
policy <- tracker <- node; ``simulate`` predicts a broadcast from the same rules.
"""
