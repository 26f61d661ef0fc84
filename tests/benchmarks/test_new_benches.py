"""The issue-35 benchmarks run end to end on tiny shapes: `roofline bench fp8` (GEMV stream and a dummy V3
decode, blocks kept vs dequantized), `roofline bench dsa` (DSA vs dense attention with the planner beside it)
and `roofline bench dbo` (dual-batch overlap on two gloo ranks).  Figures are the benchmarks' business; these
check the plumbing and that each reports what it claims to."""

import argparse
import json

import pytest

from roofline.cpu import ops as cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels unavailable (no C compiler)")


def test_fp8_gemv_and_decode(tmp_path):
    from roofline.benchmarks import fp8_weights

    rows = fp8_weights.bench_gemv(1, shapes=[(256, 384, "tiny")])
    assert rows[0]["fp8_us"] > 0 and 0 < rows[0]["fp8_stream_vs_copy"]
    fp8_weights.write_dummy_v3(str(tmp_path), hidden=256, layers=2, experts=8, moe_inter=128)
    native = fp8_weights.decode_tokens_per_s(str(tmp_path), "native", new_tokens=2, repeats=1)
    dense = fp8_weights.decode_tokens_per_s(str(tmp_path), "dequantize", new_tokens=2, repeats=1)
    assert native["kept_in_blocks"] > 0 and dense["kept_in_blocks"] == 0
    # the projections at one byte a weight (plus scales) against four; embedding and LM head fp32 in both
    assert native["weight_bytes"] < dense["weight_bytes"] and native["weight_bytes_per_token"] < dense["weight_bytes_per_token"]


def test_dsa_against_dense_with_the_planner(capsys):
    from roofline.benchmarks import sparse_attention

    args = argparse.Namespace(contexts=[48, 96], hidden=64, heads=4, q_lora_rank=32, index_topk=32, layers=1,
                              block_size=16, repeats=1, rounds=1, threads=0, json=True)
    assert sparse_attention.run(args) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and out.count("\n") >= 5
    # each context is predicted with the probes of its own rounds, which the row carries
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    for row in rows:
        assert row["probed_sparse_attention_flops"] > 0 and row["probed_bandwidth"] > 0
        assert row["dsa_predicted_ms_per_token"] == pytest.approx(1e3 * sparse_attention.predicted_attention_s(
            sparse_attention._config(args, False), row["context"], row["probed_bandwidth"],
            {k: row["probed_" + k] for k in ("attention_flops", "indexer_flops", "sparse_attention_flops")}))


def test_dsa_layer_calls_are_timed_cold(monkeypatch):
    """The layer's calls take the probes' cold timing (caches emptied before each), as the kernel probes the
    planner prices them with: a 4k context's cache rows fit a last-level cache back to back."""
    from roofline.benchmarks import sparse_attention
    from roofline.planner import probes

    timed = []

    def spy(fn, repeats):
        fn()
        timed.append(repeats)
        return 0.25

    monkeypatch.setattr(probes, "cold_median_time", spy)
    args = argparse.Namespace(contexts=[48], hidden=64, heads=4, q_lora_rank=32, index_topk=32, layers=1)
    layer = sparse_attention._layer(sparse_attention._config(args, False))
    assert sparse_attention.time_decode(layer, 48, 16, repeats=3) == 0.25 and timed == [3]


def test_dbo_on_two_ranks(capsys):
    from roofline.benchmarks import dual_batch

    args = argparse.Namespace(ranks=2, threads=1, tokens=8, hidden=32, intermediate=16, experts=4, top_k=2,
                              layers=1, skew=1.0, steps=1, json=False)
    assert dual_batch.run(args) == 0
    out = capsys.readouterr().out
    assert out.count("|") >= 6 and "hidden" in out
