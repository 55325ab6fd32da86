"""Checkpoint loading: sharded, tied/untied, round trip, and one error naming every problem."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asynct import AsyncTForCausalLM
from asynct.model.checkpoint import CheckpointError, make_checkpoint


def logits(model, ids):
    with torch.no_grad():
        return model(ids[None]).logits[0]


IDS = torch.arange(3, 40)


@pytest.mark.parametrize("tied", [True, False])
def test_sharded_equals_single(tmp_path, tied):
    single = make_checkpoint("tiny", tmp_path / "one", seed=5, tie_word_embeddings=tied)
    sharded = make_checkpoint("tiny", tmp_path / "many", seed=5, tie_word_embeddings=tied, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert ("lm_head.weight" in load_file(single / "model.safetensors")) != tied
    a = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    assert torch.equal(logits(a, IDS), logits(b, IDS))


def test_save_pretrained_round_trips(tmp_path, tiny_ckpt):
    a = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    a.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "asynct"
    b = AsyncTForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(logits(a, IDS), logits(b, IDS))
    ta, tb = load_file(tiny_ckpt / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_scalar_and_channel_alpha_round_trip(tmp_path, tiny_ckpt):
    t = load_file(tiny_ckpt / "model.safetensors")
    t["model.norm.alpha"] = torch.full((64,), 0.7)
    t["model.layers.0.self_attn.q_norm.weight"] = torch.full((1,), 1.5)
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    save_file(t, tmp_path / "ck" / "model.safetensors", metadata={"format": "pt"})
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32)
    assert m.model.norm.alpha.shape == (64,) and m.model.layers[1].input_layernorm.alpha.shape == (1,)
    m.save_pretrained(tmp_path / "out")
    assert load_file(tmp_path / "out" / "model.safetensors")["model.layers.0.self_attn.q_norm.weight"].shape == (1,)


def test_every_problem_listed_once(tmp_path, tiny_ckpt):
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    t = load_file(tiny_ckpt / "model.safetensors")
    del t["model.layers.1.mlp.up_proj.weight"]
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    t["model.layers.0.self_attn.sigma"] = torch.zeros(5)
    t["model.layers.0.extra.bias"] = torch.zeros(2)
    t["model.norm.alpha"] = torch.zeros(7)
    save_file(t, tmp_path / "ck" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32)
    msg = str(e.value)
    assert len(e.value.problems) == 5, msg
    for name in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.sigma", "model.layers.0.extra.bias", "model.norm.alpha"):
        assert name in msg


def test_config_contradicting_tensors(tmp_path, tiny_ckpt):
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    cfg.update(vocab_size=300, num_hidden_layers=3, tie_word_embeddings=True)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    msg = str(e.value)
    assert "model.embed_tokens.weight has shape [259, 64]" in msg and "[300, 64]" in msg
    assert "missing tensor model.layers.2.self_attn.q_proj.weight" in msg
    assert "unexpected tensor lm_head.weight" in msg and "tie_word_embeddings" in msg


@pytest.mark.parametrize("field,value", [("asynci_relu_pre", "false"), ("asynci_pool_size", "3"),
                                         ("tie_word_embeddings", "false"), ("eos_token_id", "256")])
def test_config_values_of_the_wrong_type(tmp_path, tiny_ckpt, field, value):
    """A string "false" for asynci_relu_pre read as true: the model ran with ReLU silently; for
    tie_word_embeddings it tied the output embedding to the input one (or, with lm_head.weight
    stored, failed saying config.json says tie_word_embeddings=true); an eos_token_id "256"
    matched no sampled token, so nothing stopped at EOS."""
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    cfg = {**json.loads((tiny_ckpt / "config.json").read_text()), field: value}
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"{field}='{value}'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ck")


@pytest.mark.parametrize("tied", [0, 1])
def test_config_booleans_written_as_0_or_1_load(tmp_path, tied):
    """Converters that write tie_word_embeddings as 0 or 1 loaded right (the model reads it as
    true or false) until the check for a string "false" refused every non-boolean."""
    import shutil
    ckpt = make_checkpoint("tiny", tmp_path / "ck", seed=5, tie_word_embeddings=bool(tied))
    cfg = {**json.loads((ckpt / "config.json").read_text()), "tie_word_embeddings": tied}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    shutil.copytree(ckpt, tmp_path / "bool")
    cfg["tie_word_embeddings"] = bool(tied)
    (tmp_path / "bool" / "config.json").write_text(json.dumps(cfg))
    model = AsyncTForCausalLM.from_pretrained(ckpt).float()
    assert torch.equal(logits(model, IDS), logits(AsyncTForCausalLM.from_pretrained(tmp_path / "bool").float(), IDS))


def test_missing_files(tmp_path, tiny_ckpt):
    with pytest.raises(CheckpointError, match="no such directory"):   # said "not a directory"
        AsyncTForCausalLM.from_pretrained(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="a file, not a checkpoint directory"):
        AsyncTForCausalLM.from_pretrained(tiny_ckpt / "config.json")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        AsyncTForCausalLM.from_pretrained(tmp_path / "empty")
    bad = json.loads((tiny_ckpt / "config.json").read_text())
    del bad["hidden_size"]
    (tmp_path / "empty" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="hidden_size"):
        AsyncTForCausalLM.from_pretrained(tmp_path / "empty")


UNREADABLE_JSON = [  # (file, text, error): json's JSONDecodeError, or a bare AttributeError / KeyError
    ("config.json", "{not json", "config.json is not valid JSON"),
    ("model.safetensors.index.json", "{not json", "model.safetensors.index.json is not valid JSON"),
    *[("config.json", text, "config.json is not a JSON object") for text in ("[]", "null", '"asynct"')],
    *[("model.safetensors.index.json", text, "model.safetensors.index.json has no weight_map")
      for text in ('{"metadata": {}}', "[]", '{"weight_map": ["model.safetensors"]}')],
    ("model.safetensors.index.json", '{"weight_map": {"model.norm.weight": 3}}',   # a TypeError traceback
     "maps model.norm.weight to 3, not a shard file name"),
]


@pytest.mark.parametrize("name,text,error", UNREADABLE_JSON)
def test_unreadable_json_names_its_file(tmp_path, tiny_ckpt, name, text, error):
    """Each came out as json's or Python's own error, naming neither the file nor the checkpoint."""
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    (tmp_path / "ck" / name).write_text(text)
    with pytest.raises(CheckpointError, match=error):
        AsyncTForCausalLM.from_pretrained(tmp_path / "ck")


@pytest.mark.parametrize("data", [b"", b"garbage" * 10, "truncated"])
def test_unreadable_safetensors_names_the_file(tmp_path, tiny_ckpt, data):
    """safetensors' own SafetensorError ("header too large") named no file."""
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100] if data == "truncated" else data)
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        AsyncTForCausalLM.from_pretrained(tmp_path / "ck")


@pytest.mark.parametrize("field,value", [("hidden_size", "64"), ("vocab_size", 259.0), ("num_attention_heads", 0),
                                         ("max_position_embeddings", 0), ("num_hidden_layers", -1)])
def test_config_sizes_must_be_positive_integers(tmp_path, tiny_ckpt, field, value):
    """A string or float size failed deep in loading (a TypeError from torch), a zero head count
    divided by zero, max_position_embeddings=0 built an engine that took no prompt."""
    import re
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    cfg = {**json.loads((tiny_ckpt / "config.json").read_text()), field: value, "head_dim": None}
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(f"{field}={value!r} must be a positive integer")):
        AsyncTForCausalLM.from_pretrained(tmp_path / "ck")


@pytest.mark.parametrize("dtype", ["float8", "int8"])
def test_config_dtype_must_be_floating(tmp_path, tiny_ckpt, dtype):
    """An unknown torch_dtype raised AttributeError from inside transformers' config; an integer
    one loaded the weights as integers."""
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    cfg = {**json.loads((tiny_ckpt / "config.json").read_text()), "torch_dtype": dtype, "dtype": dtype}
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"torch_dtype='{dtype}' is not a floating dtype"):
        AsyncTForCausalLM.from_pretrained(tmp_path / "ck")


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_tensors_must_be_floating_point(tmp_path, tiny_ckpt, dtype):
    """An int8 (quantised) or bool tensor was cast to the model's dtype and loaded silently: the
    engine and the reference model ran and wrote garbage."""
    import shutil
    shutil.copytree(tiny_ckpt, tmp_path / "ck")
    t = load_file(tiny_ckpt / "model.safetensors")
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(dtype)
    save_file(t, tmp_path / "ck" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor model.layers.0.mlp.up_proj.weight has dtype (I8|BOOL)") as e:
        AsyncTForCausalLM.from_pretrained(tmp_path / "ck")
    assert len(e.value.problems) == 1


def test_a_tensor_in_two_shards(tmp_path):
    """The loaders read every shard and the last in name order won, silently."""
    ckpt = make_checkpoint("tiny", tmp_path / "ck", seed=5, max_shard_size="100KB")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    first, last = shards[0], shards[-1]
    a, b = load_file(first), load_file(last)
    name = next(iter(a))
    save_file({**b, name: a[name] + 1}, last, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor {name} is stored twice, in {first.name} and {last.name}"):
        AsyncTForCausalLM.from_pretrained(ckpt)
