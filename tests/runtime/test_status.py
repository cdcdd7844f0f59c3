"""The failure board: what a rank whose proxy died posts, and what its peers read (one store, no processes)."""
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
