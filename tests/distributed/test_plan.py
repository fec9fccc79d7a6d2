"""The tensor-parallel plan and its validation: no process is started here."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from roseinfer.config import EngineConfig
from roseinfer.distributed.comm import Rendezvous
from roseinfer.distributed.plan import make_plan, split_even
from roseinfer.distributed.step import StepMessage
from roseinfer.model.attention_metadata import SeqSpec
from roseinfer.model.config import ModelConfig
from roseinfer.model.loader import load_checkpoint
from tests.distributed.helpers import engine, save_gpt2, save_llama

SMOLLM2 = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                      intermediate_size=1536, max_position_embeddings=8192,
                      tie_word_embeddings=True)


def _config(**kw: object) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=128, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                max_position_embeddings=64)
    return ModelConfig(**{**base, **kw})


def test_smollm2_splits_unevenly_by_whole_kv_heads() -> None:
    plan = make_plan(SMOLLM2, 2, "int8")
    a, b = plan.shards
    assert (a.kv_heads, a.q_heads, b.kv_heads, b.q_heads) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert (a.inter, b.inter) == ((0, 768), (768, 1536))
    assert (a.vocab, b.vocab) == ((0, 24576), (24576, 49152))
    c0, c1 = plan.rank_config(0), plan.rank_config(1)
    assert (c0.num_heads, c0.num_kv_heads, c1.num_heads, c1.num_kv_heads) == (6, 2, 3, 1)
    # o_proj's input (rank 0: query heads 0-5 = columns 0..383) and down_proj's (channels)
    assert plan.part(0, "model.layers.3.self_attn.o_proj.weight", (576, 576)) == (1, ((0, 384),))
    assert plan.part(1, "model.layers.3.self_attn.k_proj.weight", (192, 576)) == (0, ((128, 192),))
    assert plan.part(1, "model.layers.0.mlp.down_proj.weight", (576, 1536)) == (
        1, ((768, 1536),))
    assert plan.part(0, "model.embed_tokens.weight", (49152, 576)) == (0, ((0, 24576),))
    assert plan.part(0, "model.norm.weight", (576,)) is None
    # three ranks: one KV head each
    assert [s.q_heads for s in make_plan(SMOLLM2, 3, "int8").shards] == [(0, 3), (3, 6), (6, 9)]


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    plan = make_plan(_config(num_heads=4, num_kv_heads=1), 2, "int8")
    assert [(s.kv_heads, s.q_heads) for s in plan.shards] == [((0, 1), (0, 2)), ((0, 1), (2, 4))]
    plan = make_plan(_config(num_heads=6, num_kv_heads=2), 4, "none")
    assert [(s.kv_heads, s.q_heads) for s in plan.shards] == [
        ((0, 1), (0, 2)), ((0, 1), (2, 3)), ((1, 2), (3, 5)), ((1, 2), (5, 6))]


def test_gpt2_parts_take_q_k_v_of_the_fused_conv1d() -> None:
    cfg = ModelConfig(architecture="GPT2LMHeadModel", vocab_size=257, hidden_size=128,
                      num_layers=1, num_heads=4, num_kv_heads=4, head_dim=32,
                      intermediate_size=512, max_position_embeddings=64, attention_bias=True)
    plan = make_plan(cfg, 2, "int8")
    assert plan.part(1, "h.0.attn.c_attn.weight", (128, 384)) == (
        1, ((64, 128), (192, 256), (320, 384)))
    assert plan.part(0, "transformer.h.0.attn.c_proj.weight", (128, 128)) == (0, ((0, 64),))
    assert plan.part(1, "h.0.mlp.c_fc.bias", (512,)) == (0, ((256, 512),))
    assert plan.part(0, "wte.weight", (257, 128)) == (0, ((0, 129),))
    assert plan.part(0, "h.0.attn.c_proj.bias", (128,)) is None
    assert plan.added_once("h.0.attn.c_proj.bias") and not plan.added_once("h.0.mlp.c_fc.bias")
    zeroed = dict(plan.rank_weights(1, [("h.0.mlp.c_proj.bias", torch.ones(3))]))
    assert torch.equal(zeroed["h.0.mlp.c_proj.bias"], torch.zeros(3))


@pytest.mark.parametrize(("cfg", "size", "quant", "match"), [
    (_config(num_kv_heads=2), 3, "none", "multiple of 2"),
    (_config(num_heads=2, num_kv_heads=1), 4, "none", "fewer than the 4 ranks"),
    (_config(num_heads=3, num_kv_heads=3, head_dim=16, hidden_size=48), 2, "int8",
     "not on multiples of 32"),
    (_config(intermediate_size=200), 2, "int8", "intermediate_size 200"),
    (_config(architecture="Phi3ForCausalLM"), 2, "none", "does not support Phi3ForCausalLM"),
    (_config(architecture="GemmaForCausalLM"), 2, "none", "does not support Gemma"),
])
def test_unshardable_models_are_refused(cfg: ModelConfig, size: int, quant: str,
                                        match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_plan(cfg, size, quant)


def test_alignment_only_binds_int8() -> None:
    cfg = _config(num_heads=3, num_kv_heads=3, head_dim=16, hidden_size=48)
    assert [s.q_heads for s in make_plan(cfg, 2, "none").shards] == [(0, 2), (2, 3)]
    assert split_even(224, 2, 32) == [(0, 128), (128, 224)]


@pytest.mark.parametrize(("field", "value"), [
    ("tensor_parallel_size", 0), ("tensor_parallel_size", -1), ("tensor_parallel_size", 1.5),
    ("tensor_parallel_size", True), ("tensor_parallel_size", "2"),
    ("distributed_init_method", "127.0.0.1:29500"), ("distributed_init_method", "tcp://host"),
    ("distributed_init_method", "env://"), ("distributed_timeout_s", 0),
])
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


def test_init_method_and_threads() -> None:
    assert Rendezvous.from_init_method("tcp://10.0.0.2:29500") == Rendezvous("10.0.0.2", 29500)
    assert Rendezvous.from_init_method(None) == Rendezvous("127.0.0.1", 0)
    cfg = EngineConfig(tensor_parallel_size=64)
    assert cfg.resolved_num_threads() == 1
    assert EngineConfig(tensor_parallel_size=2, num_threads=3).resolved_num_threads() == 3


def test_unshardable_checkpoint_fails_before_any_process(tmp_path: Path) -> None:
    path = save_gpt2(tmp_path / "gpt2", n_embd=48, n_head=3)  # heads of 16: 32 + 16
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match="not on multiples of 32"):
        engine(path, 2, quantization="int8")
    with pytest.raises(ValueError, match="tensor_parallel_size=4 cannot split"):
        engine(path, 4, quantization="none")  # 3 heads cannot be shared by 4 ranks
    assert len(multiprocessing.active_children()) == before


def test_model_object_and_tensor_parallel_refused() -> None:
    from roseinfer.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="a model object cannot be given"):
        LLMEngine(EngineConfig(tensor_parallel_size=2), model=torch.nn.Linear(1, 1),
                  model_config=SMOLLM2)


def test_selected_parts_equal_slices_of_the_whole(tmp_path: Path) -> None:
    path = save_llama(tmp_path / "llama")
    cfg = load_checkpoint(path).config
    plan = make_plan(cfg, 2, "int8")
    whole = dict(load_checkpoint(path).weights)
    for rank in (0, 1):
        parts = dict(load_checkpoint(path, lambda n, s, r=rank: plan.part(r, n, s)).weights)
        assert parts.keys() == whole.keys()
        for name, tensor in parts.items():
            part = plan.part(rank, name, tuple(whole[name].shape))
            want = whole[name] if part is None else torch.cat(
                [whole[name].narrow(part[0], a, b - a) for a, b in part[1]], part[0])
            assert torch.equal(tensor, want), name
    # a .pt file (read whole, then cut) gives the same parts
    torch.save({"config": _hf_config(path), "state_dict": whole}, tmp_path / "m.pt")
    parts = dict(load_checkpoint(tmp_path / "m.pt", lambda n, s: plan.part(1, n, s)).weights)
    assert parts["model.layers.1.mlp.down_proj.weight"].shape == (192, 96)


def _hf_config(path: Path) -> dict:
    import json

    return json.loads((path / "config.json").read_text())


def test_step_message_round_trip() -> None:
    msg = StepMessage([5, 6, 7, 8, 9], [SeqSpec(3, 1, [4]), SeqSpec(0, 4, [1, 2, 0])], [0, 4])
    header, payload = msg.pack()
    assert StepMessage.payload_size(header) == payload.numel()
    back = StepMessage.unpack(header, payload)
    assert back.token_ids == msg.token_ids and back.rows == msg.rows
    assert [(s.num_computed_tokens, s.num_new_tokens, s.block_table) for s in back.seqs] == [
        (3, 1, [4]), (0, 4, [1, 2, 0])]


def test_cli_flags() -> None:
    from roseinfer.cli import build_parser, engine_config_from_args, main

    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--tensor-parallel-size", "2",
         "--distributed-init-method", "tcp://127.0.0.1:29511"])
    cfg = engine_config_from_args(args)
    assert (cfg.tensor_parallel_size, cfg.distributed_init_method) == (2, "tcp://127.0.0.1:29511")
    assert main(["generate", "--prompt", "x", "--tensor-parallel-size", "0"]) == 2  # no trace
