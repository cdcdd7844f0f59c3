"""proxy.topology: each rank of a node gets its own NICs, all NICs are used, none twice."""
import pytest
from hypothesis import given, strategies as st

from moe_a2a.proxy.topology import nics_for_rank


def test_p5_like_node_gives_each_gpu_four_nics_in_order():
    nics = [f"rdmap{i}-rdm" for i in range(32)]
    assert nics_for_rank(nics, 0, 8) == nics[:4] and nics_for_rank(nics, 7, 8) == nics[28:]


@given(n_nics=st.integers(1, 40), ranks=st.integers(1, 16))
def test_shares_are_disjoint_equal_and_cover_what_divides(n_nics, ranks):
    nics = [f"nic{i}" for i in range(n_nics)]
    shares = [nics_for_rank(nics, r, ranks) for r in range(ranks)]
    assert all(len(s) == len(shares[0]) >= 1 for s in shares)
    if n_nics >= ranks:  # each NIC used by at most one rank; only the remainder is left idle
        flat = [x for s in shares for x in s]
        assert len(flat) == len(set(flat)) == n_nics // ranks * ranks
    else:  # fewer NICs than ranks: shared round-robin, every NIC used
        assert {s[0] for s in shares} == set(nics)


def test_bad_arguments():
    with pytest.raises(ValueError, match="no NIC"):
        nics_for_rank([], 0, 1)
    with pytest.raises(ValueError, match="outside"):
        nics_for_rank(["a"], 2, 2)
