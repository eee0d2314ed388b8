"""A peer's reports to its tracker, read off the frames its tracker link posts."""
import queue
import time
from types import SimpleNamespace

from p2pweights.wire import protocol
from p2pweights.swarm.node.member import Membership
from p2pweights.wire.protocol import Msg
from p2pweights.swarm.policy.pull import PullScheduler
from p2pweights.swarm.policy.serve import UploadScheduler

CHUNK = 1 << 20


def test_a_heartbeat_reports_each_partner_s_rate_while_asked_and_what_it_delivered_since_the_last():
    clock = [0.0]
    pull = PullScheduler(8, CHUNK, clock=lambda: clock[0])
    for rank in (1, 2):
        pull.add(rank)
        pull.ready(rank, [1] * 8)
    posted = []
    node = SimpleNamespace(clock=lambda: clock[0], pull=pull, store=SimpleNamespace(count=0))
    tracker_link = SimpleNamespace(send=lambda frame, flags: posted.append(frame))
    member = Membership(node, tracker_link, "10.0.0.1:7420", {}, tracker_timeout=10.0, give_up_after=10.0)

    def beat() -> dict:
        member.heartbeat()
        event = protocol.decode([posted.pop()])
        assert event.type == Msg.HEARTBEAT
        return event.fields

    for t, rank, index in ((0.1, 1, 0), (0.2, 1, 1), (0.3, 2, 2)):
        clock[0] = t
        pull.arrived(rank, index, ok=True)
    clock[0] = 0.5
    first = beat()
    assert first["got"] == {"1": round(2 * CHUNK / 0.5), "2": round(CHUNK / 0.5)}
    assert set(first["links"]) == {"1", "2"}  # the rates while asked, measured per chunk
    clock[0] = 0.75
    pull.arrived(1, 3, ok=True)
    pull.arrived(2, 4, ok=False)  # a chunk that failed verification delivered nothing
    clock[0] = 1.0
    assert beat()["got"] == {"1": round(CHUNK / 0.5)}
    clock[0] = 1.5
    assert beat()["got"] == {}


def test_a_probe_goes_out_as_we_attach_holds_our_uploads_and_reports_its_rate():
    # the probe's bytes go to a real probe sink on loopback, timed off the loop; its result comes
    # back through the inbox and is reported.  Having sent nothing yet, we forward nothing while it
    # runs; a probe beside forwarding (a tracker that restarted mid-transfer) says it was not alone
    from p2pweights.swarm.tracker.tracker import PROBE_BYTES
    from p2pweights.swarm.node.uplink import ProbeSink

    sink = ProbeSink("127.0.0.1")
    try:
        for sent in (0, 5):
            posted, inbox = [], queue.Queue()
            serve = UploadScheduler(8, holds=lambda i: True, clock=time.monotonic)
            serve.attach(b"child")
            serve.request(b"child", [3])  # a chunk asked of us, which we hold
            node = SimpleNamespace(clock=time.monotonic, pull=PullScheduler(8, CHUNK), serve=serve,
                                   stats=SimpleNamespace(chunks_sent=sent), post=lambda verb, body: inbox.put(body))
            link = SimpleNamespace(send=lambda frame, flags: posted.append(frame))
            member = Membership(node, link, f"127.0.0.1:{sink.port}", {}, tracker_timeout=10.0, give_up_after=10.0,
                                probe={"port": sink.port, "bytes": PROBE_BYTES})
            assert serve.pending() == (sent != 0)  # having sent nothing yet, we hold it while probing
            body = inbox.get(timeout=30)
            assert posted == []
            if sent:
                node.stats.chunks_sent += 1  # forwarded one while the probe ran
            member.timed(body)
            assert serve.pending() and serve.next() == (b"child", 3)
            [event] = [protocol.decode([frame]) for frame in posted]
            assert event.type == Msg.PROBE and event.fields["rate"] > 0 and event.fields["took"] >= 0
            assert event.fields["alone"] is (sent == 0)
        while sink.drained < 2 * PROBE_BYTES:  # every byte reached the sink (the test's timeout bounds this)
            time.sleep(0.01)
        assert sink.drained == 2 * PROBE_BYTES
        serve.hold(time.monotonic() + 60)
        member.timed(b"")  # a probe that failed: nothing told, nothing held
        assert len(posted) == 1 and serve.held_until == 0.0
    finally:
        sink.close()


def test_a_welcome_s_malformed_probe_ask_sends_nothing():
    posted = []
    node = SimpleNamespace(clock=lambda: 0.0, pull=PullScheduler(8, CHUNK),
                           post=lambda verb, body: posted.append(verb))
    link = SimpleNamespace(send=lambda frame, flags: posted.append(frame))
    for ask in (1 << 20, {"port": 0, "bytes": 1 << 20}, {"port": 7421, "bytes": 1 << 30}, {"port": "x", "bytes": 1},
                {"port": 7421, "bytes": True}):
        member = Membership(node, link, "127.0.0.1:7420", {}, tracker_timeout=10.0, give_up_after=10.0, probe=ask)
        assert member.probe_due is None
    assert posted == []


def test_a_probe_acknowledged_within_its_hold_was_alone_however_late_its_report_came():
    # on a busy machine the loop hears of a probe late, after the hold ran out and we forwarded: what
    # counts is whether its last byte was acknowledged while our uploads were held
    from p2pweights.swarm.node.member import PROBE_HOLD, TIMED

    posted = []
    serve = UploadScheduler(8, holds=lambda i: True, clock=time.monotonic)
    node = SimpleNamespace(clock=time.monotonic, pull=PullScheduler(8, CHUNK), serve=serve,
                           stats=SimpleNamespace(chunks_sent=0))
    link = SimpleNamespace(send=lambda frame, flags: posted.append(frame))
    member = Membership(node, link, "127.0.0.1:7420", {}, tracker_timeout=10.0, give_up_after=10.0)
    node.stats.chunks_sent = 3  # the hold ran out before the report came: we forwarded
    for after, alone in ((PROBE_HOLD / 2, True), (2 * PROBE_HOLD, False)):
        member.timed(TIMED.pack(13e6, 0.08, after))
        assert protocol.decode([posted.pop()]).fields["alone"] is alone
    member.probe_sent = 3  # probing while already forwarding (no hold): alone only if we sent nothing since
    member.timed(TIMED.pack(50e6, 0.02, PROBE_HOLD / 2))
    assert protocol.decode([posted.pop()]).fields["alone"] is True
    node.stats.chunks_sent = 4
    member.timed(TIMED.pack(50e6, 0.02, PROBE_HOLD / 2))
    assert protocol.decode([posted.pop()]).fields["alone"] is False
