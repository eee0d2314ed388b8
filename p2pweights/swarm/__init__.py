"""The swarm: the node's event loop and handlers, the pure pull and serve schedulers, partners, the tracker and its placement, membership, the uplink probe, the fleet snapshot and simulator."""
