"""hf.from_pretrained: small random transformers models, seeded over real sockets, loaded as views, same outputs."""
import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
from safetensors.torch import save_file  # noqa: E402
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import p2pweights  # noqa: E402
from p2pweights import hf  # noqa: E402
from p2pweights.sources.pack import pack  # noqa: E402

CHUNK = 64 << 10


def llama(tie: bool, layers: int = 2, hidden: int = 64, vocab: int = 512) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def bert() -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    return BertModel(config).eval()


@pytest.fixture
def seeded():
    """seeded(path) -> 'host:port' of an in-process seeder; every seeder and loaded download closed after."""
    started = []

    def start(path):
        s = p2pweights.seed(path, port=0, host="127.0.0.1", chunk_size=CHUNK)
        started.append(s)
        return f"127.0.0.1:{s.port}"
    yield start
    for x in reversed(started):
        x.close()


@pytest.fixture
def loads():
    opened = []

    def load(parent, *args, **kw):
        model, dl = hf.from_pretrained(parent, *args, host="127.0.0.1", connect_timeout=20, timeout=60, **kw)
        opened.append(dl)
        return model, dl
    yield load
    for dl in opened:
        dl.close()


def greedy_tokens(model, prompt):
    return model.generate(prompt, max_new_tokens=8, do_sample=False)


def assert_views_of_buffer(model, dl):
    """Every parameter and persistent buffer lies in the download's device buffer: no copy."""
    buf = dl.loader.sink.buffer
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    persistent = set(model.state_dict())
    tensors = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    tensors += [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent]
    outside = [n for n, t in tensors if not lo <= t.data_ptr() < hi]
    assert not outside and tensors


def assert_same_buffers(got, want):
    """Non-persistent buffers (not in the checkpoint) rebuilt to transformers' values."""
    gb, wb = dict(got.named_buffers()), dict(want.named_buffers())
    assert gb.keys() == wb.keys()
    for name in wb:
        assert gb[name].device.type != "meta" and torch.equal(gb[name].cpu(), wb[name]), name


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_greedy_tokens_equal(tmp_path, seeded, loads, tie):
    original = llama(tie)
    original.save_pretrained(tmp_path / "m")
    with open(tmp_path / "m" / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    out = tmp_path / "out" if tie else None  # with --out the files land on disk too; the model never reads them
    model, dl = loads(seeded(tmp_path / "m"), out=out)
    assert type(model) is LlamaForCausalLM and not model.training
    assert_views_of_buffer(model, dl)
    assert_same_buffers(model, original)
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"
    if tie:  # the checkpoint holds the embedding once; the head shares that one parameter
        assert "lm_head.weight" not in {t["name"] for t in dl.manifest.tensors}
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    prompt = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(greedy_tokens(model, prompt), greedy_tokens(original, prompt))
    if out is not None:
        dl.wait(timeout=60)
        assert (out / "config.json").read_bytes() == (tmp_path / "m" / "config.json").read_bytes()


def test_bert_outputs_equal(tmp_path, seeded, loads):
    original = bert()
    original.save_pretrained(tmp_path / "b")
    model, dl = loads(seeded(tmp_path / "b"), transformers.AutoModel)
    assert type(model) is BertModel
    assert_views_of_buffer(model, dl)
    assert_same_buffers(model, original)  # position_ids and token_type_ids are non-persistent
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, original(ids).last_hidden_state)


def test_base_model_from_a_checkpoint_with_a_head(tmp_path, seeded, loads):
    original = llama(False)
    original.save_pretrained(tmp_path / "m")
    model, _ = loads(seeded(tmp_path / "m"), "AutoModel")  # LlamaModel: 'model.' prefix dropped, lm_head unused
    assert type(model).__name__ == "LlamaModel"
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).last_hidden_state, original.model(ids).last_hidden_state)


def write_checkpoint(path, model, tensors: dict):
    path.mkdir()
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor_is_one_clear_error(tmp_path, seeded):
    original = llama(False)
    sd = {k: v.contiguous() for k, v in original.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    write_checkpoint(tmp_path / "m", original, sd)
    parent = seeded(tmp_path / "m")
    with pytest.raises(p2pweights.P2PError) as e:
        hf.from_pretrained(parent, host="127.0.0.1", timeout=60)
    msg = str(e.value)
    assert "\n" not in msg and "does not match LlamaForCausalLM" in msg
    assert "1 missing from the checkpoint (model.layers.1.mlp.up_proj.weight)" in msg


@pytest.mark.parametrize("make,extra", [(lambda: llama(False), "model.layers.0.mlp.extra.weight"),
                                        (bert, "encoder.layer.0.extra.weight")], ids=["llama", "bert"])
def test_unexpected_tensor_is_one_clear_error(tmp_path, seeded, make, extra):
    original = make()
    sd = {k: v.contiguous() for k, v in original.state_dict().items()}
    sd[extra] = torch.zeros(4, 4)
    write_checkpoint(tmp_path / "m", original, sd)
    with pytest.raises(p2pweights.P2PError, match=rf"1 in the checkpoint but not in {type(original).__name__} "
                                                  rf"\({re.escape(extra)}\)"):
        hf.from_pretrained(seeded(tmp_path / "m"), host="127.0.0.1", timeout=60)


def test_wrong_shape_is_one_clear_error(tmp_path, seeded):
    original = llama(False)
    sd = {k: v.contiguous() for k, v in original.state_dict().items()}
    sd["model.norm.weight"] = torch.ones(32)
    write_checkpoint(tmp_path / "m", original, sd)
    with pytest.raises(p2pweights.P2PError, match=r"1 tensors differ in shape \(model\.norm\.weight: "
                                                  r"checkpoint \[32\], model \[64\]\)"):
        hf.from_pretrained(seeded(tmp_path / "m"), host="127.0.0.1", timeout=60)


def test_no_config_is_one_clear_error(tmp_path, seeded):
    save_file({"w": torch.zeros(4)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(p2pweights.P2PError, match=r"has no config\.json \(files: w\.safetensors\)"):
        hf.from_pretrained(seeded(tmp_path / "w.safetensors"), host="127.0.0.1", timeout=60)


def test_buffer_init_weights_does_not_compute_is_named(tmp_path, seeded, monkeypatch):
    """A model whose _init_weights leaves a non-persistent buffer unset gets an error naming it, not garbage."""
    original = llama(False)
    original.save_pretrained(tmp_path / "m")
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

    monkeypatch.setattr(LlamaPreTrainedModel, "_init_weights", lambda self, module: None)
    with pytest.raises(p2pweights.P2PError, match=r"does not compute the non-persistent buffers "
                                                  r"model\.rotary_emb\.inv_freq"):
        hf.from_pretrained(seeded(tmp_path / "m"), host="127.0.0.1", timeout=60)


def test_dtype_cast(tmp_path, seeded, loads):
    original = llama(False)
    original.save_pretrained(tmp_path / "m")
    model, _ = loads(seeded(tmp_path / "m"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    want = LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == want.model.rotary_emb.inv_freq.dtype
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)


def test_execute_while_load_returns_before_the_last_chunk(tmp_path, procs, loads):
    """stream=True over a throttled seeder: the model comes back with most chunks missing, layer 0 runs
    before the last chunk is verified, and the greedy tokens still equal the original's."""
    original = llama(False, layers=6, hidden=128, vocab=1024)
    original.save_pretrained(tmp_path / "m")
    pack(tmp_path / "m", tmp_path / "p")  # forward-pass order: layer 0 early, lm_head last
    _, info = procs.seeder(tmp_path / "p", "--chunk-size", CHUNK, env={"P2PW_FAULTS": "delay_send=20"})
    model, dl = loads(f"127.0.0.1:{info['port']}", stream=True, window=2)
    at_return = dl.progress
    assert at_return["chunks"] < at_return["n_chunks"] // 2
    seen = {}
    q = model.model.layers[0].self_attn.q_proj
    q.register_forward_hook(lambda *_: seen.setdefault("layer0", (dl.store.count, bool(dl.store.have[-1]))) and None)
    head = next(t for t in dl.manifest.tensors if t["name"] == "lm_head.weight")
    head_last = dl.manifest.chunks_covering(head["offset"], head["offset"] + head["nbytes"])[-1]
    model.lm_head.register_forward_hook(
        lambda *_: seen.setdefault("head", bool(dl.store.have[head_last])) and None)
    prompt = torch.randint(0, 1024, (1, 8), generator=torch.Generator().manual_seed(5))
    got = greedy_tokens(model, prompt)
    count, last_held = seen["layer0"]
    assert not last_held and count < at_return["n_chunks"]  # layer 0 computed while later chunks streamed
    assert seen["head"]  # the head waited for its bytes
    assert torch.equal(got, greedy_tokens(original, prompt))
    assert not model._forward_pre_hooks and not q._forward_pre_hooks  # one-shot waits, gone after the first pass
    assert_views_of_buffer(model, dl)
