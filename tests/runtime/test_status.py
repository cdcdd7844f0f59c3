"""The failure board: what a rank whose proxy died posts, and what its peers read (one store, no processes); what
kernels record, raised once each."""
import torch.distributed as dist

from moe_a2a.runtime.status import FailureBoard


def test_a_posted_failure_is_read_once_by_every_peer_and_never_by_its_poster():
    store = dist.HashStore()
    boards = [FailureBoard(store, "moe_a2a/failures/x/", r, 3) for r in range(3)]
    assert all(b.failed_peers() == [] for b in boards)  # nothing posted: nothing to stop for
    boards[1].post("its proxy process exited with code -9")
    assert boards[1].failed_peers() == []  # a rank does not stop for its own post (it already has)
    for r in (0, 2):
        assert boards[r].failed_peers() == [(1, "its proxy process exited with code -9")]
        assert boards[r].failed_peers() == []  # read once: nothing new since
    boards[2].post("its proxy process exited with code 1")
    assert boards[0].failed_peers() == [(1, "its proxy process exited with code -9"),
                                        (2, "its proxy process exited with code 1")]


def test_instances_do_not_see_each_others_failures():
    store = dist.HashStore()
    FailureBoard(store, "moe_a2a/failures/a/", 0, 2).post("its proxy process exited with code -9")
    assert FailureBoard(store, "moe_a2a/failures/b/", 1, 2).failed_peers() == []


def test_a_store_that_stops_answering_ends_the_watching_not_the_calls():
    class GoneStore:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise RuntimeError("Connection reset by peer")
            return fail

    board = FailureBoard(GoneStore(), "moe_a2a/failures/x/", 0, 2)
    assert board.failed_peers() is None  # the watch thread then stops reading the board
    board.post("its proxy process exited")  # swallowed: the peers' own timeouts remain


def test_what_kernels_record_is_raised_once_each_and_nothing_recorded_raises_nothing():
    # Status.raise_recorded reads four words when nothing is recorded; each recorded word still raises
    # its own error once, and an abort already reported stays quiet.
    from types import SimpleNamespace

    import numpy as np
    import pytest

    from moe_a2a.config import A2AConfig
    from moe_a2a.protocol.words import (Flag, encode_abort, encode_bad_bound_m, encode_bad_index, encode_capacity,
                                        flag_word)
    from moe_a2a.runtime.status import CallAborted, CapacityExceeded, Status

    cfg = A2AConfig(max_num_tokens=4, num_experts=8, experts_per_token=2, hidden_dim=64, expert_capacity=8)
    lay = cfg.layout(2)
    flags = np.zeros(flag_word(max(Flag)) + 1, dtype=np.int64)
    status = Status(SimpleNamespace(flags_np=flags, layout=lay, rank=1), cfg)
    status.raise_recorded(3)  # nothing recorded
    over = encode_capacity(2, 9, lay.num_local_experts)
    cases = [(Flag.CAPACITY_EXCEEDED, over, CapacityExceeded, "received 9 rows"),
             (Flag.BAD_BOUND_M, encode_bad_bound_m(-3), ValueError, "got -3"),
             (Flag.ABORTED, encode_abort(4, 0), CallAborted, "call 4 was aborted by rank 0"),
             (Flag.BAD_INDEX, encode_bad_index(3, 1, cfg.experts_per_token), ValueError, r"indices\[3, 1\]")]
    for flag, word, error, needle in cases:
        flags[flag_word(flag)] = word
        with pytest.raises(error, match=needle):
            status.raise_recorded(3)
        status.raise_recorded(3)  # said once (the abort's word stays: it is older than what was reported)
    assert status.abort_seen == 4 and flags[flag_word(Flag.ABORTED)] == encode_abort(4, 0)
    flags[flag_word(Flag.ABORTED)] = encode_abort(6, 1)  # a later call's abort: raised
    with pytest.raises(CallAborted, match="call 6 was aborted by rank 1"):
        status.raise_recorded(6)


def test_timeout_messages_state_the_timeout_in_force():
    """The proxy gives up at 0.8 x timeout_s (its message reaches the model first): its "timed out after 8s"
    says so, with timeout_s (issue 31: "timed out after 8s" with timeout_s=10 read as a wrong timeout)."""
    from moe_a2a.runtime.status import proxy_timeout_message

    said = "rank 1: dispatch (epoch 3) timed out after 8s; missing peers [0]"
    assert proxy_timeout_message(said, 10.0) == ("rank 1: dispatch (epoch 3) timed out after 8 s (0.8 x timeout_s=10 "
                                                 "s, so the model hears it first); missing peers [0]")
    assert proxy_timeout_message("x: timed out after 4.8s", 6.0).endswith("after 4.8 s (0.8 x timeout_s=6 s, so the "
                                                                          "model hears it first)")
    other = proxy_timeout_message("rank 1: proxy 0: no answer", 10.0)
    assert other == "rank 1: proxy 0: no answer (the proxy's waits end after 8 s: 0.8 x timeout_s=10 s, so the model " \
                    "hears it first)"


def test_a_proxy_posts_without_torch_what_torchs_own_clients_read(tmp_path):
    """`post_failure` (the proxy's, no torch) writes c10d's FileStore and TCPStore formats: the peers' boards,
    on torch's own clients, read the post once, like one of `FailureBoard.post`."""
    import datetime

    from moe_a2a.protocol.board import board_ops, post_failure

    file_store = dist.FileStore(str(tmp_path / "store"), 2)
    file_store.add("moe_a2a/failures/x/count", 1)  # a post before ours: the add continues from it
    stores = [(file_store, ("file", str(tmp_path / "store")))]
    for libuv in (True, False):
        tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10), use_libuv=libuv)
        stores.append((tcp, ("tcp", "127.0.0.1", tcp.port)))
    for store, address in stores:
        peer = FailureBoard(store, "moe_a2a/failures/x/", 0, 2)
        peer.seen = store.add("moe_a2a/failures/x/count", 0)
        assert post_failure(address, "moe_a2a/failures/x/", 1, "its model process (pid 7) died")
        assert peer.failed_peers() == [(1, "its model process (pid 7) died")], address
        assert peer.failed_peers() == []
        assert board_ops(address, [("moe_a2a/failures/x/probe", None, 2)]) == [2]
    assert not post_failure(("file", str(tmp_path / "gone")), "p/", 1, "x")  # no store left: nothing, no error
