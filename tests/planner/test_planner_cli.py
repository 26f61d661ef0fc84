"""`roofline plan` command line: registration, JSON keys, table, plot, argument errors."""

import argparse
import json

import pytest

from roofline.planner import cli

REQUIRED_KEYS = [
    "weight_bytes_per_gpu", "kv_bytes_per_token", "kv_blocks", "kv_tokens", "max_seqs_at_context",
    "naive_max_seqs", "paged_max_seqs", "decode_step_ms", "decode_tokens_per_s",
    "decode_intensity_flops_per_byte", "ridge_flops_per_byte", "saturation_batch", "prefill_ms",
    "kv_fits_at_batch",
]


def _parser():
    parser = argparse.ArgumentParser(prog="roofline")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.register(sub)
    return parser


def _run(argv, capsys):
    args = _parser().parse_args(["plan", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_register_adds_plan_with_func():
    args = _parser().parse_args(["plan", "--model", "llama-3-8b", "--gpu", "h100-sxm"])
    assert args.command == "plan" and callable(args.func)
    assert args.block_size == 16 and args.tp == 1 and args.gpu_memory_utilization == 0.9


def test_json_has_issue_keys(capsys):
    rc, out, _ = _run(["--model", "llama-3-70b", "--gpu", "h100-sxm", "--tp", "2", "--weight-dtype", "fp8",
                       "--kv-dtype", "bf16", "--context", "2048", "--batch", "32", "--hbm-bandwidth-tbs", "1.675",
                       "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    for k in REQUIRED_KEYS:
        assert k in d, k
    assert d["kv_bytes_per_token"] == 163840  # per GPU after the TP split
    assert d["decode_step_ms"] == pytest.approx(27, rel=0.05)
    assert d["kv_fits_at_batch"] is True
    assert d["inputs"]["tp"] == 2 and d["hardware"]["name"] == "h100-sxm"


def test_kv_budget_flag_is_exact(capsys):
    rc, out, _ = _run(["--model", "llama-3-70b", "--gpu", "h100", "--weight-dtype", "fp8", "--kv-budget-gib", "40",
                       "--context", "4096", "--avg-context", "800", "--json"], capsys)
    d = json.loads(out)
    assert (d["kv_blocks"], d["kv_tokens"], d["max_seqs_at_context"]) == (8192, 131072, 32)
    assert (d["naive_max_seqs"], d["paged_max_seqs"]) == (32, 163)


def test_table_output(capsys):
    rc, out, _ = _run(["--model", "deepseek-v3", "--gpu", "h200", "--tp", "8"], capsys)
    assert rc == 0
    for k in ("weight_bytes_per_gpu", "kv_bytes_per_token", "paged_max_seqs", "decode_step_ms", "saturation_batch",
              "prefill_ms", "kv_fits_at_batch", "MLA"):
        assert k in out
    assert "70,272 B" in out  # MLA latent bytes per token


def test_plot(tmp_path, capsys):
    path = tmp_path / "sweep.png"
    rc, out, _ = _run(["--model", "llama-3-8b", "--gpu", "l4", "--context", "2048", "--plot", str(path)], capsys)
    assert rc == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_hf_dir_model(tmp_path, capsys):
    from roofline.planner.model_specs import MODEL_PRESETS

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MODEL_PRESETS["llama-3-8b"]))
    rc, out, _ = _run(["--model", str(d), "--gpu", "a100-80gb", "--json"], capsys)
    assert rc == 0 and json.loads(out)["kv_bytes_per_token"] == 131072


def test_cpu_with_explicit_figures_needs_no_measurement(capsys):
    rc, out, _ = _run(["--gpu", "cpu", "--weight-dtype", "fp32", "--hbm-bandwidth-tbs", "0.03", "--peak-tflops", "0.1",
                       "--context", "48", "--batch", "1", "--json"], capsys)
    d = json.loads(out)
    assert d["hardware"]["name"] == "cpu" and d["hardware"]["measured"] is False
    # default model (SmolLM2-135M), fp32: 538 MB read per step at 30 GB/s ~ 18 ms
    assert d["decode_step_ms"] == pytest.approx(0.1345e9 * 4 / 0.03e12 * 1e3, rel=0.02)


def test_errors(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["plan", "--gpu", "h100", "--gpu-memory-utilization", "0.8", "--kv-budget-gib", "4"])
    capsys.readouterr()
    rc, _, err = _run(["--model", "nonexistent-model", "--gpu", "h100"], capsys)
    assert rc == 2 and "unknown model" in err
    rc, _, err = _run(["--model", "llama-3-8b"], capsys)
    assert rc == 2 and "--gpu" in err
    rc, _, err = _run(["--model", "llama-3-8b", "--gpu", "tpu"], capsys)
    assert rc == 2


def test_main_entry(capsys):
    assert cli.main(["--model", "qwen3-8b", "--gpu", "h100-sxm", "--json"]) == 0
    assert "decode_step_ms" in json.loads(capsys.readouterr().out)
