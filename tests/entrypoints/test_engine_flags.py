"""Engine flags: --speculative-config takes a JSON object (vLLM's speculative_config) and is validated
with the other engine arguments, errors naming the field."""

from __future__ import annotations

import argparse

import pytest

from roofline.entrypoints.engine_flags import add_engine_args, engine_args_from


def parse(*argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_args_from(p.parse_args(list(argv)))


def test_speculative_config_json():
    args = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    spec = args.create_engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 3, 2, 4)
    assert parse().create_engine_config().speculative_config is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_speculative_config_must_be_a_json_object(text, capsys):
    with pytest.raises(SystemExit):
        parse("--speculative-config", text)
    assert "--speculative-config" in capsys.readouterr().err


def test_speculative_config_errors_name_the_field():
    args = parse("--speculative-config", '{"method": "eagle9", "num_speculative_tokens": 3}')
    with pytest.raises(ValueError, match=r"speculative_config\.method"):
        args.create_engine_config()
    args = parse("-tp", "2", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 3}')
    with pytest.raises(ValueError, match=r"speculative_config\.draft_tensor_parallel_size"):
        args.create_engine_config()


def test_target_itl_ms_flag():
    assert parse("--target-itl-ms", "40").create_engine_config().scheduler_config.target_itl_ms == 40.0
    assert parse().create_engine_config().scheduler_config.target_itl_ms is None  # the default target
    assert parse("--target-itl-ms", "0").create_engine_config().scheduler_config.target_itl_ms == 0.0  # off
    for argv, why in ((("--target-itl-ms", "-5"), "must be positive"),
                      (("--target-itl-ms", "40", "--no-enable-chunked-prefill"), "needs chunked prefill"),
                      (("--target-itl-ms", "40", "--data-parallel-size", "2"), "needs data_parallel_size 1")):
        with pytest.raises(ValueError, match=f"target_itl_ms {why}"):
            parse(*argv).create_engine_config()
