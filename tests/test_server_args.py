"""ServerArgs: one dataclass, argparse built from it, validated once with messages that name the flag."""

from __future__ import annotations

import pytest

from radixserve.server_args import ServerArgs, prepare_server_args


def test_cli_round_trip() -> None:
    args = prepare_server_args(["--port", "31000", "--max-total-tokens", "2048", "--disable-radix-cache",
                                "--schedule-policy", "lpm", "--dtype", "bfloat16", "--chunked-prefill-size", "-1"])
    assert (args.port, args.max_total_tokens, args.disable_radix_cache) == (31000, 2048, True)
    assert args.schedule_policy == "lpm" and args.dtype == "bfloat16" and args.chunk_size is None
    assert args.host == "127.0.0.1"  # never binds every interface unless told to
    assert args.responses_store_size == 1000
    assert prepare_server_args(["--responses-store-size", "0"]).responses_store_size == 0


@pytest.mark.parametrize("kw,flag", [
    ({"load_format": "pickle"}, "--load-format"),
    ({"device": "tpu"}, "--device"),
    ({"max_total_tokens": 0}, "--max-total-tokens"),
    ({"max_running_requests": -3}, "--max-running-requests"),
    ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
    ({"port": 70000}, "--port"),
    ({"chunked_prefill_size": 0}, "--chunked-prefill-size"),
    ({"tp_size": 0}, "--tp-size"),
    ({"nnodes": 2}, "--dist-init-addr"),
    ({"node_rank": 3, "nnodes": 2, "dist_init_addr": "127.0.0.1:5000"}, "--node-rank"),
    ({"model_path": "/definitely/not/here"}, "--model-path"),
    ({"schedule_policy": "sjf"}, "--schedule-policy"),
    ({"piecewise_cuda_graph_max_tokens": -1}, "--piecewise-cuda-graph-max-tokens"),
    ({"piecewise_cuda_graph_max_tokens": 1.5}, "--piecewise-cuda-graph-max-tokens"),
    ({"pooling_method": "mean"}, "--pooling-method"),  # without --is-embedding
    ({"watchdog_timeout": 0}, "--watchdog-timeout"),
    ({"enable_overlap_schedule": True, "disable_overlap_schedule": True}, "--enable-overlap-schedule"),
    ({"base_gpu_id": -1}, "--base-gpu-id"),
    ({"tokenizer_path": "/definitely/not/here"}, "--tokenizer-path"),
    ({"max_lora_rank": 16}, "--max-lora-rank"),  # without LoRA serving
    ({"lora_target_modules": ["q_proj"]}, "--lora-target-modules"),
    ({"responses_store_size": -1}, "--responses-store-size"),
    ({"responses_store_size": 1.5}, "--responses-store-size"),
])
def test_invalid_values_name_the_flag(kw, flag) -> None:
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kw)


def test_unknown_keyword_rejected() -> None:
    with pytest.raises(ValueError, match="unknown server argument"):
        ServerArgs.from_kwargs(max_tokens=5)


def test_argparse_rejects_bad_choice(capsys) -> None:
    with pytest.raises(SystemExit):
        prepare_server_args(["--attention-backend", "flash"])
    assert "--attention-backend" in capsys.readouterr().err


@pytest.mark.integration
def test_chat_template_file_overrides_the_tokenizers(embedded_model_path, tmp_path) -> None:
    from radixserve import Engine

    bad = tmp_path / "missing.jinja"
    with pytest.raises(ValueError, match="--chat-template"):
        ServerArgs(chat_template=str(bad))
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    with Engine(model_path=embedded_model_path, max_total_tokens=512, chat_template=str(template),
                log_requests=True, log_level="warning") as e:
        tok = e.tokenizer_manager.tokenizer
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<<hi>>"
        assert e.generate("Hi", {"max_new_tokens": 2, "temperature": 0})["meta_info"]["completion_tokens"] == 2


def test_choices_come_from_the_registries() -> None:
    from radixserve.constrained import GRAMMAR_BACKENDS as grammar_registry
    from radixserve.layers.attention import ATTENTION_BACKENDS as attention_registry
    from radixserve.server_args import ATTENTION_BACKENDS, GRAMMAR_BACKENDS

    assert ATTENTION_BACKENDS == tuple(attention_registry)
    assert GRAMMAR_BACKENDS == (*grammar_registry, "none")


def test_every_registered_model_class_imports() -> None:
    from radixserve.models.registry import get_model_class, supported_architectures

    for arch in supported_architectures():
        assert get_model_class([arch]).__name__ == arch
    with pytest.raises(ValueError, match="not supported"):
        get_model_class(["NoSuchForCausalLM"])


def test_dp_attention_needs_matching_tp_and_dp_sizes() -> None:
    for kw in ({"tp_size": 1, "dp_size": 1}, {"tp_size": 2, "dp_size": 1}, {"tp_size": 2, "dp_size": 4}):
        with pytest.raises(ValueError, match="--enable-dp-attention"):
            ServerArgs(enable_dp_attention=True, **kw)


def test_a_tokenizer_path_without_a_tokenizer_is_refused(embedded_model_path, tmp_path) -> None:
    """An explicit --tokenizer-path that holds no tokenizer fails at start (a model folder without one serves
    token ids only, with a warning)."""
    from radixserve.entrypoints.engine import resolve_model

    with pytest.raises(ValueError, match="--tokenizer-path .* holds no tokenizer"):
        resolve_model(ServerArgs(model_path=embedded_model_path, tokenizer_path=str(tmp_path), device="cpu"))
    args = ServerArgs(model_path=embedded_model_path, tokenizer_path=embedded_model_path, device="cpu")
    resolve_model(args)
    assert not args.skip_tokenizer_init


def test_help_shows_the_defaults() -> None:
    """`--help` is where the README sends users for every flag: the flags with a fixed default show it."""
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    raw = parser.format_help()
    text = " ".join(raw.split())
    sections = {part.split()[0]: " ".join(part.split()) for part in raw.split("\n  --")[1:]}  # one an option
    for flag, default in [("port", "30000"), ("host", "127.0.0.1"), ("page-size", "1"), ("schedule-policy", "fcfs"),
                          ("request-read-timeout", "30.0"), ("torch-compile-max-bs", "32"),
                          ("speculative-num-draft-tokens", "4"), ("decode-log-interval", "40")]:
        assert f"(default: {default})" in sections[flag], sections[flag]
    # no "(default: None)" for flags whose default depends on the model or the device, no second default
    assert "(default: None)" not in text
    assert "(default: on CUDA with graphs" in text and text.count("default:") > 20


def test_a_busy_port_names_the_flag() -> None:
    import socket

    from radixserve.entrypoints.http_server import _check_port_free

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(RuntimeError, match="choose a free port with --port"):
            _check_port_free("127.0.0.1", s.getsockname()[1])
