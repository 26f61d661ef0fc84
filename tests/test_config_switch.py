"""config.Switch: on unless set off; forcing nests and restores; the engine sets the CPU switches from
its EngineConfig fields, which --help lists."""

from roofline.config import EngineArgs, Switch


def test_default_on_and_forcing():
    s = Switch("cpu_test_switch")
    assert s.on()
    with s.forced(False):
        assert not s.on()
        with s.forced(True):
            assert s.on()
        assert not s.on()
    assert s.on() and s.override is None
    s.set(False)
    assert not s.on()
    s.set(None)
    assert s.on()


def test_engine_config_sets_the_cpu_switches():
    from roofline.cpu import ops as cpu_ops, greedy_head
    from roofline.model_executor.layers.moe import cpu_experts
    from roofline.model_executor.models import llama_cpu_stack
    from roofline.worker.worker import REUSE_FREED_MEMORY, apply_cpu_settings

    switches = (llama_cpu_stack.SWITCH, greedy_head.SWITCH, cpu_experts.SWITCH, REUSE_FREED_MEMORY)
    try:
        dc = EngineArgs(cpu_layer_stack=False, cpu_greedy_head=False, cpu_moe_kernels=False,
                        cpu_reuse_freed_memory=False).create_engine_config().device_config
        apply_cpu_settings(dc)
        assert not any(s.on() for s in switches) and cpu_ops.SWITCH.on()
        apply_cpu_settings(EngineArgs().create_engine_config().device_config)
        assert all(s.on() for s in switches)
    finally:
        for s in switches:
            s.set(None)


def test_cpu_flags_are_in_help():
    import argparse

    from roofline.entrypoints.engine_flags import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = parser.format_help()
    for flag in ("--cpu-kernels", "--no-cpu-layer-stack", "--cpu-isa", "--no-cpu-greedy-head", "--cpu-moe-kernels",
                 "--cpu-reuse-freed-memory", "--gguf-activations"):
        assert flag in text, flag
