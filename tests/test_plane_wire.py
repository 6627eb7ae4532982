"""The parameter plane's data connection (lsgd/plane/wire.py) over socket pairs: whole
transfers, refusals, forgery, resumption, a pipelined chain, deadlines. Small vectors."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from lsgd.plane import wire
from lsgd.plane.route import Reception
from lsgd.plane.wire import Header, TransferError, as_bytes, receive_vector, send_vector

SECRET = b"a job secret of enough bytes, 32+"


def header(count: int, chunk: int = 7, **kw) -> Header:
    base = dict(job="job", round_id=5, epoch=0, kind=0, wire=0, sender=1, receiver=2,
                count=count, chunk=chunk)
    return Header(**(base | kw))


def sender_handshake(ch, h: Header) -> None:
    """A hand-made sender's side of the handshake, up to the receiver's acceptance."""
    _, _, nonce = wire._HELLO.unpack(ch.read(wire._HELLO.size))
    mine = bytes(range(wire.NONCE))
    ch.keyed(nonce + mine)
    ch.send(wire.TO_RECEIVER, h.pack(), mine)
    ch.read(wire._REPLY.size + wire.MAC)


def run_pair(send, receive):
    """Run ``send(sock)`` in a thread and ``receive(sock)`` here; (send's error, receive's
    result or error)."""
    a, b = socket.socketpair()
    box = {}

    def sender():
        try:
            send(a)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            box["send"] = exc
        finally:
            a.close()

    t = threading.Thread(target=sender)
    t.start()
    try:
        got = receive(b)
    except Exception as exc:  # noqa: BLE001
        got = exc
    finally:
        b.close()
        t.join(10)
    assert not t.is_alive()
    return box.get("send"), got


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_vector_arrives_whole_in_chunks(secret):
    src = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    out = np.zeros(50, np.float32)
    rx, seen = Reception(50), []
    err, got = run_pair(
        lambda s: send_vector(s, header(50), as_bytes(src), secret, timeout=5),
        lambda s: receive_vector(s, as_bytes(out), rx, secret, 5, admit=lambda h: None,
                                 on_chunk=lambda at, n: seen.append((at, n))))
    assert err is None and got == header(50)
    assert rx.complete and np.array_equal(out, src)
    assert seen == [(i, min(7, 50 - i)) for i in range(0, 50, 7)]


def test_a_refusal_reaches_the_sender_and_writes_nothing():
    src, out = np.ones(10, np.float32), np.zeros(10, np.float32)
    err, got = run_pair(
        lambda s: send_vector(s, header(10), as_bytes(src), SECRET, timeout=5),
        lambda s: receive_vector(s, as_bytes(out), Reception(10), SECRET, 5,
                                 admit=lambda h: f"round {h.round_id} is not open"))
    assert isinstance(err, TransferError) and "refused the transfer: round 5 is not open" in str(err)
    assert isinstance(got, TransferError) and not out.any()


def test_another_secret_is_refused_at_the_header():
    src, out = np.ones(10, np.float32), np.zeros(10, np.float32)
    rx = Reception(10)
    err, got = run_pair(
        lambda s: send_vector(s, header(10), as_bytes(src), b"not the job's secret", timeout=5),
        lambda s: receive_vector(s, as_bytes(out), rx, SECRET, 5, admit=lambda h: None))
    assert isinstance(got, TransferError) and "MAC does not match" in str(got)
    assert isinstance(err, TransferError) and rx.offset == 0 and not out.any()


def test_a_count_other_than_the_models_is_refused():
    src, out = np.ones(12, np.float32), np.zeros(10, np.float32)
    err, got = run_pair(
        lambda s: send_vector(s, header(12), as_bytes(src), SECRET, timeout=5),
        lambda s: receive_vector(s, as_bytes(out), Reception(10), SECRET, 5, admit=lambda h: None))
    assert isinstance(err, TransferError) and "has 10 elements, not 12" in str(err)
    assert not out.any()


def test_a_rerouted_sender_resumes_where_the_receiver_stopped():
    src = np.arange(20, dtype=np.float32)
    out = np.zeros(20, np.float32)
    rx = Reception(20)
    rx.open(0)
    rx.accept(0, 0, 6)  # the first sender got 6 elements through, then stalled
    out[:6] = src[:6]
    seen = []
    err, got = run_pair(
        lambda s: send_vector(s, header(20, epoch=1), as_bytes(src), SECRET, timeout=5),
        lambda s: receive_vector(s, as_bytes(out), rx, SECRET, 5, admit=lambda h: None,
                                 on_chunk=lambda at, n: seen.append(at)))
    assert err is None and seen[0] == 6 and np.array_equal(out, src)
    # the bypassed sender's epoch is refused from now on
    err, got = run_pair(
        lambda s: send_vector(s, header(20, epoch=0), as_bytes(src), SECRET, timeout=5),
        lambda s: receive_vector(s, as_bytes(out), rx, SECRET, 5, admit=lambda h: None))
    assert isinstance(err, TransferError) and "older than epoch 1" in str(err)


def test_a_chunk_out_of_place_from_a_node_with_the_secret_is_refused():
    """A sender that holds the secret but sends a chunk beyond the held prefix."""
    out = np.zeros(10, np.float32)
    rx = Reception(10)

    def rogue(s):
        ch = wire._Channel(s, SECRET, deadline=wire.time.monotonic() + 5)
        sender_handshake(ch, header(10))
        ch.send(wire.TO_RECEIVER, wire._CHUNK.pack(3, 7), bulk=memoryview(b"\xff" * 28))

    err, got = run_pair(rogue, lambda s: receive_vector(s, as_bytes(out), rx, SECRET, 5,
                                                        admit=lambda h: None))
    assert isinstance(got, TransferError) and "7 elements at 3; expected 7 at 0" in str(got)
    assert rx.offset == 0 and not out.any()


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_chunk_of_another_size_than_the_headers_is_refused(secret):
    """Every chunk but the last has the header's chunk size: a shorter one (its bytes then
    read as the next chunk's start) is refused, and nothing of it is written."""
    out = np.zeros(10, np.float32)
    rx = Reception(10)

    def short(s):
        ch = wire._Channel(s, secret, deadline=wire.time.monotonic() + 5)
        sender_handshake(ch, header(10))
        for at in (0, 2, 4, 6, 8):  # chunks of 2 where the header says 7
            ch.send(wire.TO_RECEIVER, wire._CHUNK.pack(at, 2), bulk=memoryview(b"\xff" * 8))

    err, got = run_pair(short, lambda s: receive_vector(s, as_bytes(out), rx, secret, 5,
                                                        admit=lambda h: None))
    assert isinstance(got, TransferError) and "2 elements at 0; expected 7 at 0" in str(got)
    assert rx.offset == 0 and not out.any()


def test_a_silent_sender_ends_at_the_deadline():
    out = np.zeros(4, np.float32)
    a, b = socket.socketpair()
    try:
        t0 = wire.time.monotonic()
        with pytest.raises(TransferError, match="deadline"):
            receive_vector(b, as_bytes(out), Reception(4), SECRET, 0.3, admit=lambda h: None)
        assert wire.time.monotonic() - t0 < 2
    finally:
        a.close()
        b.close()


def test_a_member_forwards_each_chunk_as_it_arrives():
    """A -> B -> C: B forwards from its staging buffer what it holds so far."""
    src = np.random.default_rng(1).standard_normal(100).astype(np.float32)
    at_b, at_c = np.zeros(100, np.float32), np.zeros(100, np.float32)
    rx_b, rx_c = Reception(100), Reception(100)
    held = threading.Condition()

    def chunk_ready(end: int) -> int:
        with held:
            held.wait_for(lambda: rx_b.offset >= end or rx_b.offset == 100, timeout=5)
            return rx_b.offset

    def arrived(at: int, n: int) -> None:
        with held:
            held.notify_all()

    ab, ba = socket.socketpair()
    bc, cb = socket.socketpair()
    errors = []

    def run(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(lambda: send_vector(ab, header(100, chunk=9), as_bytes(src), SECRET, 5),)),
        threading.Thread(target=run, args=(lambda: receive_vector(ba, as_bytes(at_b), rx_b, SECRET, 5, admit=lambda h: None, on_chunk=arrived),)),
        threading.Thread(target=run, args=(lambda: send_vector(bc, header(100, chunk=4, sender=2, receiver=3), as_bytes(at_b), SECRET, 5, chunk_ready=chunk_ready),)),
    ]
    for t in threads:
        t.start()
    receive_vector(cb, as_bytes(at_c), rx_c, SECRET, 5, admit=lambda h: None)
    for t in threads:
        t.join(5)
    for s in (ab, ba, bc, cb):
        s.close()
    assert not errors, errors
    assert np.array_equal(at_b, src) and np.array_equal(at_c, src)


def test_a_chunk_altered_on_the_way_is_refused_and_writes_nothing():
    """The chunk's bytes are under its MAC (AES-GMAC, bound to its number and offset): one
    flipped byte on the wire is refused before anything reaches the staging buffer."""
    out = np.zeros(10, np.float32)
    rx = Reception(10)

    def tampered(s):
        ch = wire._Channel(s, SECRET, deadline=wire.time.monotonic() + 5)
        sender_handshake(ch, header(10))
        good = bytes(range(28))
        bad = bytes([good[0] ^ 1]) + good[1:]
        raw = wire._CHUNK.pack(0, 7)
        mac = ch._mac(wire.TO_RECEIVER, ch.sent, (raw,), memoryview(good))
        ch._sendall([raw, bad, mac])

    err, got = run_pair(tampered, lambda s: receive_vector(s, as_bytes(out), rx, SECRET, 5,
                                                           admit=lambda h: None))
    assert isinstance(got, TransferError) and "MAC does not match" in str(got)
    assert rx.offset == 0 and not out.any()


def test_a_receivers_old_answers_replayed_to_a_sender_do_not_pass():
    """The keys are derived from both sides' nonces: a man in the middle who replays a
    receiver's hello, acceptance and DONE from an earlier connection (the sender would report a
    transfer that never happened) fails the sender's MAC check."""
    hello_nonce, earlier_sender_nonce = b"n" * wire.NONCE, b"e" * wire.NONCE
    old = wire._Channel(socket.socket(), SECRET, deadline=wire.time.monotonic() + 5)
    old.keyed(hello_nonce + earlier_sender_nonce)  # the recorded connection's keys
    reply = wire._REPLY.pack(0, 0, 0)
    recorded = [wire._HELLO.pack(wire.MAGIC, wire.VERSION, hello_nonce),
                reply, old._mac(wire.TO_SENDER, 0, (reply, b""), None)]

    def replayer(s):
        s.sendall(recorded[0])
        s.recv(1 << 16)  # the new header, nonce and MAC
        s.sendall(recorded[1] + recorded[2])

    data = as_bytes(np.ones(10, np.float32))
    err, got = run_pair(lambda s: send_vector(s, header(10), data, SECRET, 5), replayer)
    assert isinstance(err, TransferError) and "MAC does not match" in str(err)


def test_a_receiver_that_takes_a_chunk_only_a_trickle_at_a_time_is_a_stall():
    """A sender's stall time bounds each whole message, as Python's sendall time-out did: a
    receiver that reads a few bytes now and then never leaves the sender without progress for
    the stall time, yet holds up the route as a hung one does."""
    count, chunk = 1 << 22, 1 << 20  # 16 MiB in 4 MiB chunks, taken at about 1.6 MB/s

    def trickle(s):
        s.sendall(wire._HELLO.pack(wire.MAGIC, wire.VERSION, bytes(wire.NONCE)))
        need = wire._HEADER.size + wire.NONCE + wire.MAC
        got = b""
        while len(got) < need:
            got += s.recv(need - len(got))
        s.sendall(wire._REPLY.pack(0, 0, 0) + bytes(wire.MAC))
        end = wire.time.monotonic() + 5
        while wire.time.monotonic() < end:
            try:
                if not s.recv(32768):
                    return
            except OSError:
                return
            wire.time.sleep(0.02)

    data = as_bytes(np.ones(count, np.float32))
    t0 = wire.time.monotonic()
    err, _ = run_pair(lambda s: send_vector(s, header(count, chunk), data, None, 10, stall=0.5),
                      trickle)
    assert isinstance(err, wire.Stalled), err
    assert wire.time.monotonic() - t0 < 4
