"""`moe-a2a sizes` (moe_a2a/cli.py over `runtime.traffic.sizes_report`): one rank's buffers per placement for
given sizes, the numbers `Layout` owns, beside the DeepEP facade's size hint for the same shapes."""
import json

import pytest
import torch

from moe_a2a.cli import main as cli_main
from moe_a2a.compat._slots import instance_bytes
from moe_a2a.compat.deep_ep import Buffer
from moe_a2a.config import A2AConfig


def _sizes(capsys, *argv) -> dict:
    assert cli_main(["sizes", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("world, node, dtype", [(8, None, "bf16"), (16, 8, "fp8"), (2, 1, "bf16")])
def test_sizes_report_the_layouts_bytes_per_placement_and_the_facades_hint(capsys, world, node, dtype):
    T, H, E, K = 64, 512, 32, 4
    argv = ["--tokens", str(T), "--hidden", str(H), "--experts", str(E), "--topk", str(K), "--world", str(world),
            "--dtype", dtype] + (["--node-size", str(node)] if node else [])
    rep = _sizes(capsys, *argv)
    cfg = A2AConfig(max_num_tokens=T, num_experts=E, experts_per_token=K, hidden_dim=H,
                    in_dtype=torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16, out_dtype=torch.bfloat16)
    lay = cfg.layout(world, node or world)
    assert rep["world"] == world and rep["node"] == (node or world) and rep["config"] == str(cfg)
    assert rep["rows"]["dispatch_stride_bytes"] == cfg.dispatch_stride_bytes == (H * (1 if dtype == "fp8" else 2)
                                                                                  + (16 if dtype == "fp8" else 0))
    assert rep["rows"]["count_row_bytes"] == 4 * E
    one_node = (node or world) == world
    assert list(rep["placements"]) == (["ipc", "host"] if one_node else ["nic", "staged", "host"])
    for name, b in rep["placements"].items():
        assert (b["send_bytes"], b["recv_bytes"]) == (lay.send_bytes, lay.recv_bytes)
        staged = name in ("host", "staged")
        assert b["segment_bytes"] == lay.segment_bytes(staged)
        # GPU memory: a send and a recv buffer, unless every row lives in the host segment
        assert b["device_bytes"] == (0 if name == "host" else lay.send_bytes + lay.recv_bytes)
        assert b["host_bytes"] == lay.segment_bytes(staged)
    hint = rep["deep_ep_facade_hint_bytes"]
    assert hint == Buffer.get_low_latency_rdma_size_hint(T, H, world, E) == instance_bytes(T, H, world, E, 8)


def test_sizes_prints_a_table_with_the_numbers(capsys):
    assert cli_main(["sizes", "--world", "4", "--node-size", "2", "--tokens", "16", "--hidden", "256",
                     "--experts", "16", "--topk", "2"]) == 0
    out = capsys.readouterr().out
    lay = A2AConfig(max_num_tokens=16, num_experts=16, experts_per_token=2, hidden_dim=256).layout(4, 2)
    assert f"{lay.send_bytes:,} B" in out and f"{lay.recv_bytes:,} B" in out
    assert f"{lay.send_bytes + lay.recv_bytes:,} B" in out                 # GPU bytes of nic / staged
    assert f"{Buffer.get_low_latency_rdma_size_hint(16, 256, 4, 16):,} B" in out
    for name in ("nic", "staged", "host", "get_low_latency_rdma_size_hint", "not DeepEP's formula"):
        assert name in out


@pytest.mark.parametrize("argv, needle", [
    (["--world", "4", "--node-size", "3"], "--node-size"),
    (["--world", "0"], "--world"),
    (["--dtype", "fp4"], "--dtype"),
])
def test_bad_sizes_flags_are_one_line_errors(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        cli_main(["sizes", *argv])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in last and needle in last


def test_sizes_the_config_refuses_are_exit_2_naming_why(capsys):
    assert cli_main(["sizes", "--world", "3"]) == 2    # 256 experts over 3 ranks
    assert "divisible by world_size" in capsys.readouterr().err


@pytest.mark.parametrize("wire", ["relay", "relay_fp8", "sender_reduced"])
def test_sizes_of_a_wire_count_the_relays_partial_region(capsys, wire):
    """`--wire` sizes the buffers of that wire's config: the relay's send buffer holds its fp32 partial region,
    `(W - node) * T` rows of `round_up(4H, 16)` bytes, and nothing else differs from the sender-reduced rows'."""
    T, H, E, K, W, N = 32, 96, 32, 4, 8, 4
    argv = ["--tokens", str(T), "--hidden", str(H), "--experts", str(E), "--topk", str(K), "--world", str(W),
            "--node-size", str(N), "--wire", wire]
    rep = _sizes(capsys, *argv)
    plain = _sizes(capsys, *argv[:-1], "sender_reduced_fp8" if wire.endswith("fp8") else "sender_reduced")
    partial = (W - N) * T * 4 * H if wire.startswith("relay") else 0
    assert rep["rows"]["relay_partial_bytes"] == partial
    assert rep["config"].endswith(f"relay={wire.startswith('relay')})")
    for name, b in rep["placements"].items():
        assert b["send_bytes"] - plain["placements"][name]["send_bytes"] in range(partial, partial + 4096), name
        assert b["recv_bytes"] == plain["placements"][name]["recv_bytes"], name


def test_sizes_count_a_write_piece_per_proxy_under_the_relay(capsys):
    """`--proxies k`: under the relay each write is in k pieces, one per proxy, and the segment's write tables hold
    them (k times the bytes); without the relay the proxies share whole writes and the tables stay."""
    argv = ["--world", "16", "--node-size", "8", "--tokens", "16", "--hidden", "256", "--experts", "16", "--topk", "2"]
    one = _sizes(capsys, *argv, "--wire", "relay")
    two = _sizes(capsys, *argv, "--wire", "relay", "--proxies", "2")
    route = _sizes(capsys, *argv, "--proxies", "2")
    assert two["proxies"] == 2 and two["write_table_bytes"] == 2 * one["write_table_bytes"] == 2 * 3 * 16 * 32
    assert route["write_table_bytes"] == one["write_table_bytes"]
    assert two["placements"]["nic"]["host_bytes"] >= one["placements"]["nic"]["host_bytes"]
    with pytest.raises(SystemExit):
        cli_main(["sizes", *argv, "--proxies", "17"])
    assert "--proxies" in capsys.readouterr().err
