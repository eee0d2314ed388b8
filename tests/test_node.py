"""Node state that a test can drive by hand: the clock is passed in, no loop runs."""
import pytest
import zmq

from p2pweights.sources.manifest import Manifest
from p2pweights.swarm.node.node import IDLE_FORGET, Child, Node, bind_router
from p2pweights.wire.protocol import SERVER_TRANSITIONS, Connection
from p2pweights.storage.store import Store


@pytest.fixture
def node():
    """A node on a loopback ROUTER; no loop runs.  Ends its sockets."""
    m = Manifest(total_size=8192, chunk_size=4096, chunks=["0" * 16, "0" * 16])
    ctx = zmq.Context()
    router, _ = bind_router(ctx, "127.0.0.1", 0)
    n = Node(ctx, router, m, Store(m), peer_id="t")
    yield n
    n.stop(timeout=0)  # closes the socket other threads post through
    n._close_sockets()
    ctx.term()


def test_quiet_strangers_are_forgotten_children_are_not(node):
    for ident in (b"stranger", b"child", b"hostile"):
        node.seen[ident] = 0.0
        node.conns[ident] = Connection(SERVER_TRANSITIONS, "new")
    node.bad[b"hostile"] = 40
    node.children[b"child"] = Child("c", 1)
    node._prune(IDLE_FORGET / 2)  # not quiet long enough yet
    assert set(node.conns) == {b"stranger", b"child", b"hostile"}
    node.seen[b"child"] = IDLE_FORGET  # a child heard from within its timeout (its heartbeats)
    node.next_prune = 0.0
    node._prune(IDLE_FORGET + 1)
    assert set(node.conns) == {b"child"} and set(node.seen) == {b"child"} and b"hostile" not in node.bad


def test_a_request_on_a_dropped_childs_connection_is_answered_not_counted_as_bad(node):
    from p2pweights.wire import protocol
    from p2pweights.swarm.node.handlers import Handlers
    from p2pweights.wire.protocol import Msg

    handlers = Handlers(node)
    dealer = node.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(node.router.getsockopt(zmq.LAST_ENDPOINT).decode())

        def deliver(frame: bytes) -> bytes:
            dealer.send(frame)
            assert node.router.poll(5000)
            handlers.dispatch(node.router)
            return next(iter(node.conns)) if len(node.conns) == 1 else None

        ident = deliver(protocol.control(Msg.ATTACH, peer_id="c", rank=1, model_id=node.manifest.model_id))
        assert dealer.poll(5000) and protocol.decode(dealer.recv_multipart()).type == Msg.ATTACHED
        node.forget(ident)  # as when a send to it found no connection (EHOSTUNREACH)
        deliver(protocol.request([0]))
        assert dealer.poll(5000)
        reply = protocol.decode(dealer.recv_multipart())
        assert reply.type == Msg.ERROR and not reply.fields.get("fatal")
        assert "attach again" in reply.fields["message"]
        assert node.bad == {} and node.stats.malformed == 0
    finally:
        dealer.close()


def test_leave_and_wake_reach_the_loop_through_its_inbox_and_run_its_timers_at_once(node):
    # another thread (Download.close, the disk finisher) never writes the loop's state: it posts a
    # verb, and the loop's handler sets it and has the timers run at the end of that pass (DONE and
    # LEAVE go out then, not at the next poll timeout of an idle loop)
    from p2pweights.swarm.node.handlers import Handlers

    handlers = Handlers(node)
    for verb, leaving in ((b"wake", False), (b"leave", True)):
        node.next_timers = 1e9
        node.post(verb)
        assert node.inbox.poll(5000)
        handlers.dispatch(node.inbox)
        assert node.next_timers == 0.0 and node.leave_when_done == leaving


def test_a_post_after_stop_opens_no_socket_so_the_context_can_end():
    # a probe's thread reports after the download closed: its post must not open a socket that
    # would keep the context's term() waiting forever
    import threading

    m = Manifest(total_size=8192, chunk_size=4096, chunks=["0" * 16, "0" * 16])
    ctx = zmq.Context()
    router, _ = bind_router(ctx, "127.0.0.1", 0)
    n = Node(ctx, router, m, Store(m), peer_id="t")
    n.post(b"wake")  # opens the socket other threads post through
    n.stop(timeout=0)
    late = threading.Thread(target=n.post, args=(b"uplink", b""))
    late.start()
    late.join(10)
    n._close_sockets()
    ended = threading.Thread(target=ctx.term, daemon=True)
    ended.start()
    ended.join(10)
    assert not ended.is_alive()


def test_a_child_silent_past_its_timeout_is_dropped_and_frees_its_slot(node):
    from p2pweights.swarm.tracker.admission import CHILD_TIMEOUT

    for ident, heard in ((b"idle", 0.0), (b"live", CHILD_TIMEOUT)):
        node.seen[ident] = heard
        node.children[ident] = Child("c", 1)
        node.serve.attach(ident)
    node._prune(CHILD_TIMEOUT + 1)  # peers heartbeat every link: one silent this long is gone or hostile
    assert set(node.children) == {b"live"} and not node.serve.attached(b"idle")


def test_a_partners_bad_messages_are_dropped_whole_and_the_next_one_is_read_from_its_header(node):
    # the loop reads a partner's message frame by frame (``first.more``): a bad one is dropped with all
    # its frames, so whatever follows is read from its own header, never from a leftover frame
    from p2pweights.swarm.node.handlers import Handlers
    from p2pweights.wire import protocol
    from p2pweights.wire.protocol import Msg

    fake = node.ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    try:
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        handlers = Handlers(node)
        node.partners.open(0, f"127.0.0.1:{port}")
        link = node.partners.links[0]
        assert fake.poll(5000)
        ident = fake.recv_multipart()[0]  # its ATTACH

        def deliver(*frames: bytes) -> None:
            fake.send_multipart([ident, *frames])
            assert link.socket.poll(5000)
            handlers.dispatch(link.socket)

        deliver(protocol.control(Msg.ATTACHED, n_chunks=2), protocol.pack_bits(b"\x01\x00"))
        assert node.pull.links[0].holds == 0b01 and node.stats.malformed == 0
        deliver(protocol.chunk_header(0))  # no payload frame
        deliver(protocol.chunk_header(7), b"x" * 4096, protocol.chunk_header(1), b"y" * 4096)  # not asked, 2 extra
        deliver(protocol.control(Msg.ATTACHED, n_chunks=2), b"\x00", b"more")  # not in this state, a frame extra
        assert node.stats.malformed == 3 and node.stats.chunks_received == 0
        deliver(protocol.chunk_list(Msg.HAVE, [1]))
        assert node.pull.links[0].holds == 0b11 and node.stats.malformed == 3
    finally:
        fake.close(0)
