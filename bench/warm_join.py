"""A ``p2pw join`` whose interpreter started before the clock: ``broadcast.py --warm``'s diagnostic.

It imports what a join imports, writes the file ``$P2PW_WARM_READY`` names, and blocks on its
standard input; the byte the bench then gives every host at once runs ``p2pw join`` with this
process's arguments.  Timed from that byte, a broadcast leaves out the interpreters' start-up:
on this bed N of them importing on two cores at once, which hosts with cores of their own do
not wait for.  What it measures is the bed, never a headline: a user's clock starts at launch.
"""
import importlib
import os
import sys

JOIN_MODULES = ("zmq", "p2pweights.cli", "p2pweights.api", "p2pweights.swarm.node.node", "p2pweights.swarm.policy.pull",
                "p2pweights.storage.store", "p2pweights.storage.cache", "p2pweights.storage.ring", "p2pweights.swarm.policy.serve",
                "p2pweights.swarm.node.handlers", "p2pweights.swarm.node.partners", "p2pweights.swarm.node.member", "p2pweights.swarm.node.uplink",
                "p2pweights.storage.modelcache", "p2pweights.storage.hfcache", "p2pweights.wire.keys")  # what ``p2pw join --out``
#   imports (``sys.modules`` after one): one it misses is imported after the go, as in a cold run


def main() -> None:
    for name in JOIN_MODULES:
        importlib.import_module(name)
    with open(os.environ["P2PW_WARM_READY"], "w") as f:
        f.write(str(os.getpid()))
    if not os.read(0, 1):  # the bench went away without a go
        os._exit(3)
    sys.argv[0] = "p2pw"
    from p2pweights.cli import run
    run()


if __name__ == "__main__":
    main()
