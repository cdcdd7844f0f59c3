"""The packed words: host codecs round-trip, and the kernels' encoders (protocol/device.py) write
exactly what the host decodes."""
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

from moe_a2a.protocol import device
from moe_a2a.protocol import words as w


@given(epoch=st.integers(1, 2**40), source=st.integers(0, 4095))
def test_abort_round_trips(epoch, source):
    assert w.decode_abort(w.encode_abort(epoch, source)) == (epoch, source)


@given(L=st.integers(1, 512), data=st.data())
def test_capacity_round_trips(L, data):
    expert, rows = data.draw(st.integers(0, L - 1)), data.draw(st.integers(1, 2**30))
    assert w.decode_capacity(w.encode_capacity(expert, rows, L), L) == (expert, rows)


@given(K=st.integers(1, 1024), data=st.data())
def test_bad_index_round_trips(K, data):
    t, k = data.draw(st.integers(0, 2**20)), data.draw(st.integers(0, K - 1))
    assert w.decode_bad_index(w.encode_bad_index(t, k, K), K) == (t, k)


@given(first=st.integers(0, 1000), late=st.sets(st.integers(0, 31)), proxy=st.booleans())
def test_wait_status_round_trips(first, late, proxy):
    ranks = sorted(first + i for i in late)
    word = w.encode_wait_status(ranks, first, proxy)
    assert word != 0 and w.decode_wait_status(word, first) == (ranks, proxy)


@given(bound=st.integers(-2**31, 2**31 - 1))
def test_bad_bound_m_round_trips(bound):
    word = w.encode_bad_bound_m(bound)
    assert word != 0 and w.decode_bad_bound_m(word) == bound


def test_zero_words_decode_to_nothing():
    assert w.decode_abort(0) is None and w.decode_capacity(0, 4) is None
    assert w.decode_bad_index(0, 8) is None and w.decode_wait_status(0, 0) is None
    assert w.decode_bad_bound_m(0) is None


@triton.jit
def _encode_all(out_ptr, in_ptr):
    # Inputs from memory, as the kernels have them (a scalar argument equal to 1 would be a constexpr).
    epoch, source, expert = tl.load(in_ptr + 0), tl.load(in_ptr + 1), tl.load(in_ptr + 2)
    rows, L, route = tl.load(in_ptr + 3), tl.load(in_ptr + 4), tl.load(in_ptr + 5)
    mask, proxy_late, bound = tl.load(in_ptr + 6), tl.load(in_ptr + 7), tl.load(in_ptr + 8).to(tl.int32)
    tl.store(out_ptr + 0, device.encode_abort(epoch, source))
    tl.store(out_ptr + 1, device.encode_capacity(expert, rows, L))
    tl.store(out_ptr + 2, device.encode_bad_index(route))
    tl.store(out_ptr + 3, device.encode_wait_status(mask, proxy_late != 0))
    tl.store(out_ptr + 4, device.encode_bad_bound_m(bound))


@settings(max_examples=20, deadline=None)
@given(epoch=st.integers(1, 2**31 - 1), source=st.integers(0, 4095), L=st.integers(1, 512), rows=st.integers(1, 2**20),
       route=st.integers(0, 2**30), mask=st.integers(0, 2**31 - 1), proxy=st.booleans(),
       bound=st.integers(-2**31, 2**31 - 1), data=st.data())
def test_device_encoders_match_the_host(epoch, source, L, rows, route, mask, proxy, bound, data):
    expert = data.draw(st.integers(0, L - 1))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.zeros(5, dtype=torch.int64, device=dev)
    inputs = torch.tensor([epoch, source, expert, rows, L, route, mask, int(proxy), bound], dtype=torch.int64,
                          device=dev)
    _encode_all[(1,)](out, inputs)
    K = 1 << 10
    late = [i for i in range(31) if mask >> i & 1]
    assert out.tolist() == [w.encode_abort(epoch, source), w.encode_capacity(expert, rows, L),
                            w.encode_bad_index(route // K, route % K, K), w.encode_wait_status(late, 0, proxy),
                            w.encode_bad_bound_m(bound)]
