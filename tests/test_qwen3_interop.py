"""Qwen3 in and out (interop: hf_llama.py, gguf.py, peft.py, llama2c.py, llmc.py) on tiny random
transformers Qwen3ForCausalLM models whose heads (head_dim 16) are not hidden_size / heads (48 / 4):
Hugging Face directories read with transformers' logits and written back for transformers; GGUF of
architecture qwen3 as llama.cpp's convert_hf_to_gguf.py writes it (keys, names, unpermuted q/k rows),
f32 bit for bit, bf16 and q8_0 within their rounding, read by transformers' GGUF loader; PEFT
adapters both ways; the qwen3 presets against transformers' parameter count; Qwen3's chat template
as apply_chat_template renders it; every refusal's one line, exit 2, nothing written.

With $HANDGRAD_LLAMA_CPP pointing at a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py), the
GGUF llama.cpp's own converter writes is read too; the test skips in one line without it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import handgrad  # noqa: E402
from handgrad.cli import main as cli  # noqa: E402
from handgrad.config import LlamaConfig, LoRAConfig, load_run_config  # noqa: E402
from handgrad.data.chat import load_chat_format  # noqa: E402
from handgrad.interop.checkpoint import save_weights  # noqa: E402
from handgrad.interop.hf import read_safetensors  # noqa: E402
from handgrad.interop.hf_llama import write_hf_llama  # noqa: E402
from handgrad.interop.load import load_pretrained  # noqa: E402
from handgrad.interop.peft import write_peft  # noqa: E402
from handgrad.models.decode import generate  # noqa: E402
from handgrad.models.llama import Llama, num_params  # noqa: E402

from helpers import env_without, tokenizer_files  # noqa: E402
from test_gguf import write_like_llama_cpp  # noqa: E402

Q = gguf.GGMLQuantizationType
V, C, H, NH, NKV, HD = 100, 48, 64, 4, 2, 16
IDX = np.random.default_rng(0).integers(0, V, (2, 24))


def _qwen3(tied, seed=0, hidden=C, heads=NH, kv=NKV, head_dim=HD, vocab=V):
    """A random Qwen3ForCausalLM with every weight moved far from its init, the q/k norm gains too."""
    cfg = transformers.Qwen3Config(hidden_size=hidden, intermediate_size=H, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                                   vocab_size=vocab, max_position_embeddings=128, tie_word_embeddings=tied,
                                   rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.2))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """untied float32 in one file; tied bfloat16 in shards."""
    root = tmp_path_factory.mktemp("qwen3")
    _qwen3(False).save_pretrained(root / "untied")
    _qwen3(True, seed=1).to(torch.bfloat16).save_pretrained(root / "tied", max_shard_size="20KB")
    return {"untied": root / "untied", "tied": root / "tied"}


def _reference(d, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()


def _logits(model, idx=IDX):
    with torch.no_grad():
        return model(torch.from_numpy(idx)).logits.numpy()


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# ---------------------------------------------------------------- Hugging Face in and out
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_a_qwen3_directory_gives_transformers_logits_and_greedy_decoding(hf_dirs, name):
    d = hf_dirs[name]
    config, _, info = load_pretrained(d)
    assert (config.qk_norm, config.head_dim, config.n_embd, config.n_head, config.n_kv_head) == (True, HD, C, NH, NKV)
    assert (config.qkv_bias, config.tie_embeddings, config.rope_theta, config.norm_eps) == (False, name == "tied",
                                                                                            1e6, 1e-6)
    assert info == {"format": "hf", "tokenizer": None, "eot_id": 2}
    ref, model = _reference(d), handgrad.from_pretrained(d)
    assert _rel(model.forward(IDX), _logits(ref)) < 1e-5
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        theirs = ref.generate(torch.from_numpy(IDX[:, :5]), do_sample=False, max_new_tokens=30).numpy()
    assert np.array_equal(generate(model, IDX[:, :5], 30, temperature=0), theirs)
    assert max(len(set(row[5:])) for row in theirs) >= 10  # no one-token loop


def test_an_export_is_a_qwen3_directory_transformers_loads(hf_dirs, tmp_path, capsys):
    """Through a handgrad run and back: transformers' Qwen3Config fields, the tensors bit for bit."""
    src = hf_dirs["untied"]
    assert cli(["convert", str(src), str(tmp_path / "run")]) == 0
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert "qk norm, head_dim 16" in out and "wrote Qwen3ForCausalLM" in out
    doc = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert doc["architectures"] == ["Qwen3ForCausalLM"] and doc["model_type"] == "qwen3"
    assert (doc["head_dim"], doc["attention_bias"], doc["use_sliding_window"], doc["tie_word_embeddings"]) == (
        HD, False, False, False)
    a, b = read_safetensors(src / "model.safetensors"), read_safetensors(tmp_path / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    ref = _reference(tmp_path / "hf")
    assert type(ref).__name__ == "Qwen3ForCausalLM" and ref.config.head_dim == HD
    assert _rel(_logits(ref), _logits(_reference(src))) == 0


def test_a_handgrad_qwen3_loads_in_transformers_with_handgrad_logits(tmp_path):
    """A model handgrad made (tied, 6 heads on 3, q wider than n_embd), its gains away from 1."""
    config = LlamaConfig(block_size=64, vocab_size=V, n_layer=2, n_head=6, n_kv_head=3, n_embd=40, head_dim=12,
                         ffn_hidden=56, qk_norm=True, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6)
    model = Llama(config, seed=0)
    rng = np.random.default_rng(1)
    for view in model.p.values():
        view += rng.standard_normal(view.shape).astype(np.float32) * (0.3 if view.ndim == 1 else 0.05)
    model.weights_changed()
    write_hf_llama(tmp_path / "hf", config, model.state_dict())
    assert _rel(model.forward(IDX), _logits(_reference(tmp_path / "hf"))) < 1e-5


# ---------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def models():
    return {"untied": _qwen3(False, seed=2), "tied": _qwen3(True, seed=3)}


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_a_llama_cpp_style_qwen3_gguf_gives_transformers_logits(models, name, tmp_path):
    path = write_like_llama_cpp(tmp_path / "m.gguf", models[name])
    config, weights, _ = load_pretrained(path)
    assert (config.qk_norm, config.head_dim, config.tie_embeddings) == (True, HD, name == "tied")
    q = models[name].model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert np.array_equal(np.asarray(weights["model.layers.0.self_attn.q_proj.weight"]), q)  # unpermuted
    assert _rel(handgrad.from_pretrained(path).forward(IDX), _logits(models[name])) < 1e-5


def test_gguf_export_is_llama_cpps_qwen3_and_reads_back(models, tmp_path, capsys):
    """f32: the llama.cpp-style file's tensors bit for bit, its keys; bf16 and q8_0: the types the
    converter chooses (a matrix whose rows are not whole blocks of 32 is f16 under q8_0), read back
    within their rounding."""
    src = write_like_llama_cpp(tmp_path / "src.gguf", models["untied"])
    for kind in ("f32", "bf16", "q8_0"):
        assert cli(["convert", str(src), str(tmp_path / f"{kind}.gguf"), "--format", "gguf", "--gguf-type", kind]) == 0
    assert "wrote a GGUF file (qwen3, q8_0)" in capsys.readouterr().out
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(tmp_path / "f32.gguf")
    theirs = {t.name: t for t in b.tensors}
    assert sorted(theirs) == sorted(t.name for t in a.tensors) and "blk.1.attn_k_norm.weight" in theirs
    for t in a.tensors:
        assert theirs[t.name].tensor_type == Q.F32 and np.array_equal(theirs[t.name].data, t.data), t.name
    for key in ("general.architecture", "qwen3.attention.key_length", "qwen3.attention.value_length",
                "qwen3.attention.head_count_kv", "qwen3.embedding_length", "qwen3.rope.freq_base"):
        assert b.fields[key].contents() == a.fields[key].contents(), key
    assert "qwen3.rope.dimension_count" not in b.fields  # the converter writes none for qwen3
    want = _logits(models["untied"])
    for kind, qtype, bound in (("bf16", Q.BF16, 0.05), ("q8_0", Q.Q8_0, 0.1)):
        reader = gguf.GGUFReader(tmp_path / f"{kind}.gguf")
        for t in reader.tensors:  # t.shape: GGUF's, the row (contiguous) length first
            expect = Q.F32 if len(t.shape) == 1 else Q.F16 if qtype == Q.Q8_0 and t.shape[0] % 32 else qtype
            assert t.tensor_type == expect, (kind, t.name)
        assert {t.tensor_type for t in reader.tensors} >= {qtype, Q.F32}
        assert 0 < _rel(handgrad.from_pretrained(tmp_path / f"{kind}.gguf").forward(IDX), want) < bound


def test_transformers_gguf_loader_reads_a_qwen3_export(tmp_path):
    """transformers' GGUF loader does not read qwen3.attention.key_length (it keeps Qwen3Config's
    head_dim 128), so this model's heads are 128 wide: 2 of them on a 64-wide stream."""
    model = _qwen3(False, seed=4, hidden=64, heads=2, kv=1, head_dim=128)
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "out" / "m.gguf"), "--format", "gguf"]) == 0
    ref = _reference(tmp_path / "out", gguf_file="m.gguf")
    assert type(ref).__name__ == "Qwen3ForCausalLM"
    ours = handgrad.from_pretrained(tmp_path / "out" / "m.gguf").forward(IDX)
    assert _rel(ours, _logits(ref)) < 1e-5 and _rel(ours, _logits(model)) < 1e-5


# llama.cpp's converter, run on a tokenizer trained here: its pre-tokenizer check (a hash of known
# tokenizers' ids) is answered "qwen2", Qwen3's own, and the SentencePiece attempt is skipped
CONVERTER = """import sys
root = sys.argv.pop(1)
sys.path[:0] = [root + "/gguf-py", root]
import convert_hf_to_gguf
from conversion.base import TextModel
from conversion.qwen import Qwen2Model
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
Qwen2Model.set_vocab = lambda self: self._set_vocab_gpt2()
convert_hf_to_gguf.main()
"""


def test_llama_cpps_own_converter_output_reads_with_transformers_logits(tmp_path):
    root = os.environ.get("HANDGRAD_LLAMA_CPP")
    if not root or not os.path.isfile(os.path.join(root, "convert_hf_to_gguf.py")):
        pytest.skip("set HANDGRAD_LLAMA_CPP to a llama.cpp source tree to run its convert_hf_to_gguf.py")
    d = tmp_path / "hf"
    vocab = tokenizer_files(d)
    model = _qwen3(False, seed=5, vocab=vocab)
    model.save_pretrained(d)
    done = subprocess.run([sys.executable, "-c", CONVERTER, root, str(d), "--outfile", str(tmp_path / "m.gguf"),
                           "--outtype", "f32"], capture_output=True, text=True, env=env_without(("PYTHONPATH",)),
                           cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    config, _, info = load_pretrained(tmp_path / "m.gguf")
    assert (config.qk_norm, config.head_dim, config.vocab_size) == (True, HD, vocab) and info["tokenizer"]
    idx = IDX % vocab
    assert _rel(handgrad.from_pretrained(tmp_path / "m.gguf").forward(idx), _logits(model, idx)) < 1e-5
    # handgrad's export of the same directory: the converter's tensors bit for bit, its model keys
    assert cli(["convert", str(d), str(tmp_path / "ours.gguf"), "--format", "gguf"]) == 0
    a, b = gguf.GGUFReader(tmp_path / "m.gguf"), gguf.GGUFReader(tmp_path / "ours.gguf")
    theirs = {t.name: t for t in b.tensors}
    assert sorted(theirs) == sorted(t.name for t in a.tensors)
    for t in a.tensors:
        assert np.array_equal(theirs[t.name].data, t.data), t.name
    for key in a.fields:
        if key.startswith("qwen3."):
            assert key in b.fields and b.fields[key].contents() == a.fields[key].contents(), key


# ---------------------------------------------------------------- PEFT adapters
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_peft_adapters_over_a_qwen3_both_ways(hf_dirs, tmp_path, monkeypatch):
    """handgrad's export (every linear adapted, the norms and q/k norms trained beside) loads in PEFT over
    transformers' Qwen3ForCausalLM with handgrad's logits, and AutoPeftModelForCausalLM finds that base
    class by the base it names; an adapter PEFT wrote loads in handgrad with PEFT's logits."""
    peft = pytest.importorskip("peft")
    base = hf_dirs["untied"]
    config, weights, _ = load_pretrained(base)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"), train_norms=True)
    model = Llama(config, lora=lora, seed=0)
    model.load_state_dict(weights, names=model.base_names)
    rng = np.random.default_rng(2)
    for n in model.layout:
        model.p[n] += rng.standard_normal(model.p[n].shape).astype(np.float32) * 0.1
    model.weights_changed()
    trained = {n: model.ops.to_numpy(model.p[n]) for n in model.layout}
    assert "model.layers.1.self_attn.k_norm.weight" in trained
    write_peft(tmp_path / "ours", "llama", lora, trained, base)
    doc = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert [t.rsplit(".", 1)[-1] for t in doc["target_modules"]] == TARGETS
    assert {"q_norm", "k_norm"} <= set(doc["modules_to_save"])
    ours = model.forward(IDX)
    ref = peft.PeftModel.from_pretrained(_reference(base), tmp_path / "ours").eval()
    assert _rel(ours, _logits(ref)) < 1e-5
    monkeypatch.chdir(tmp_path / "ours")  # base_model_name_or_path is relative to the adapter
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(".", dtype=torch.float32).eval()
    assert type(auto.get_base_model()).__name__ == "Qwen3ForCausalLM" and _rel(ours, _logits(auto)) < 1e-5
    config2, _, info = load_pretrained(tmp_path / "ours", merge=False)
    assert config2 == config and info["adapter"]["lora"] == lora
    assert all(np.array_equal(info["adapter"]["tensors"][n], trained[n]) for n in trained)
    # PEFT's own adapter, its base named by its path
    hf = peft.get_peft_model(_reference(base), peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    hf.save_pretrained(tmp_path / "theirs")
    assert json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    assert _rel(handgrad.from_pretrained(tmp_path / "theirs").forward(IDX), _logits(hf.eval())) < 1e-5


# ---------------------------------------------------------------- presets
@pytest.mark.parametrize("preset, n_embd, ffn_hidden", [("qwen3-0.6b", 1024, 3072), ("qwen3-1.7b", 2048, 6144)])
def test_qwen3_presets_are_the_published_shapes(preset, n_embd, ffn_hidden):
    config = load_run_config(preset).gpt_config(151936)
    assert (config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.head_dim, config.ffn_hidden) == (
        28, n_embd, 16, 8, 128, ffn_hidden)
    assert (config.qk_norm, config.qkv_bias, config.tie_embeddings, config.rope_theta, config.norm_eps,
            config.block_size) == (True, False, True, 1e6, 1e-6, 1024)
    hf = transformers.Qwen3Config(vocab_size=151936, hidden_size=n_embd, intermediate_size=ffn_hidden,
                                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                  tie_word_embeddings=True)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.Qwen3ForCausalLM(hf).parameters())
    assert num_params(config) == theirs


# ---------------------------------------------------------------- the chat template
# Qwen/Qwen3-0.6B's chat template (llama.cpp's models/templates/Qwen-Qwen3-0.6B.jinja), its tools branches cut
QWEN3_TEMPLATE = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def test_qwen3s_chat_template_renders_as_transformers_does(tmp_path):
    """Its <think> handling: a reply after the last question gets a <think> block (empty, or the
    reasoning it carried), earlier replies lose theirs; sample --chat and prepare render through it,
    and prepare's assistant mask finds each reply in a conversation of several."""
    d = tmp_path / "tok"
    tokenizer_files(d, template=QWEN3_TEMPLATE,
                    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"))
    ours, theirs = load_chat_format(d), transformers.AutoTokenizer.from_pretrained(d)
    sys_msg, ask = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}
    thought = {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nhow are you"}
    plain = {"role": "assistant", "content": "fine thank you"}
    conversations = [[ask], [sys_msg, ask], [ask, plain], [sys_msg, ask, thought],
                     [ask, thought, {"role": "user", "content": "tell me a story"}],
                     [ask, thought, {"role": "user", "content": "what is your name"}, plain]]
    for messages in conversations:
        for prompt in (False, True):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.render(messages, add_generation_prompt=prompt) == want, (messages, prompt)
    assert "\nthe user greets\n" not in ours.render(conversations[-1])  # an earlier reply's reasoning is dropped
    last = "<|im_start|>assistant\n<think>\n\n</think>\n\nfine thank you<|im_end|>\n"
    assert ours.render([ask, plain]).endswith(last)
    # prepare's mask: each reply as it stands in the whole text, up to its <|im_end|>: the last with its
    # empty <think> block, an earlier one without the block it had when it was the last
    ids, mask = ours.encode(conversations[-1])
    replies = ours.hf.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert replies == "how are you<|im_end|><think>\n\n</think>\n\nfine thank you<|im_end|>"


# ---------------------------------------------------------------- refusals: one line, exit 2, nothing written
def _refused(capsys, args, dst, match):
    assert cli(args) == 2, args
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert match in err, err
    assert not dst.exists() and not list(dst.parent.glob(f".tmp_{dst.name}*"))
    return err


def test_hf_refusals(hf_dirs, tmp_path, capsys):
    cfg = json.loads((hf_dirs["untied"] / "config.json").read_text())
    weights = read_safetensors(hf_dirs["untied"] / "model.safetensors")

    def make(name, config, w=weights):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        save_file(w, str(d / "model.safetensors"))
        return d

    family = "handgrad's llama family cannot express"
    moe = dict(cfg, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4)
    bare_moe = {k: v for k, v in moe.items() if k != "architectures"}
    bias = dict(weights, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(NH * HD, np.float32)})
    cases = [
        (make("moe", moe), f'architectures = "Qwen3MoeForCausalLM": {family} a mixture of experts; it reads dense'),
        (make("moe_type", bare_moe), f'model_type = "qwen3_moe": {family} a mixture of experts'),
        (make("window", dict(cfg, use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None)),
         f"use_sliding_window = true: {family} sliding-window attention"),
        (make("yarn", dict(cfg, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                 "original_max_position_embeddings": 32768})),
         f'rope_parameters = {{"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0, '
         f'"original_max_position_embeddings": 32768}}: {family} scaled RoPE other than Llama 3\'s'),
        (make("attn_bias", dict(cfg, attention_bias=True)),
         f"attention_bias = true: {family} biases on q/k/v/o; its Qwen3 has no biases"),
        (make("q_bias", cfg, bias), "tensor model.layers.0.self_attn.q_proj.bias: handgrad's Qwen3 has no biases"),
        (make("no_norm", cfg, {k: v for k, v in weights.items() if "k_norm" not in k}),
         "tensor model.layers.0.self_attn.k_norm.weight is missing"),
    ]
    for src, match in cases:
        assert str(src) in _refused(capsys, ["convert", str(src), str(tmp_path / "out")], tmp_path / "out", match)
    # no head_dim in config.json: transformers' Qwen3Config's, 128
    wide = {k: v.numpy() for k, v in _qwen3(False, head_dim=128).state_dict().items()}
    config, _, _ = load_pretrained(make("no_head_dim", {k: v for k, v in cfg.items() if k != "head_dim"}, wide))
    assert config.head_dim == 128


def test_gguf_refusals(models, tmp_path, capsys):
    out = tmp_path / "out"
    moe = write_like_llama_cpp(tmp_path / "moe.gguf", models["untied"], arch="qwen3moe")
    _refused(capsys, ["convert", str(moe), str(out)], out, "general.architecture = 'qwen3moe': a mixture of experts")
    value = write_like_llama_cpp(tmp_path / "value.gguf", models["untied"], value_length=8)
    _refused(capsys, ["convert", str(value), str(out)], out, "qwen3.attention.value_length = 8: heads (or rotary "
             "dimensions) 8 wide, which handgrad's llama family cannot express: its heads are "
             "qwen3.attention.key_length = 16 wide")
    freqs = write_like_llama_cpp(tmp_path / "freqs.gguf", models["untied"],
                                 extra={"add_tensor": ("rope_freqs.weight", np.ones(HD // 2, np.float32))})
    _refused(capsys, ["convert", str(freqs), str(out)], out, "RoPE frequency factors in a qwen3 model")


def test_export_refusals(hf_dirs, tmp_path, capsys):
    """llama2.c and llm.c files hold no q/k norms; no format but handgrad's holds q/k norms with biases;
    llama.cpp's qwen3 applies no Llama 3 RoPE scaling."""
    run = tmp_path / "run"
    assert cli(["convert", str(hf_dirs["untied"]), str(run)]) == 0
    capsys.readouterr()
    _refused(capsys, ["convert", str(run), str(tmp_path / "l2c"), "--format", "llama2c"], tmp_path / "l2c",
             "the model has q/k norms (Qwen3), which llama2.c's format cannot hold")
    _refused(capsys, ["convert", str(run), str(tmp_path / "m.bin"), "--format", "llmc"], tmp_path / "m.bin",
             "--format llmc: a llama model with Qwen3's q/k norms; llm.c's model file holds GPT-2 models only")
    both = LlamaConfig(block_size=32, vocab_size=V, n_layer=1, n_head=NH, n_kv_head=NKV, n_embd=C, head_dim=HD,
                       ffn_hidden=H, qk_norm=True, qkv_bias=True)
    save_weights(tmp_path / "both", 0, both, Llama(both, seed=0).state_dict())
    for fmt, dst in (("hf", tmp_path / "hf"), ("gguf", tmp_path / "b.gguf")):
        _refused(capsys, ["convert", str(tmp_path / "both"), str(dst), "--format", fmt], dst,
                 f"--format {fmt}: the model has both q/k norms (Qwen3) and q/k/v biases (Qwen2)")
    scaled = LlamaConfig(block_size=32, vocab_size=V, n_layer=1, n_head=NH, n_kv_head=NKV, n_embd=C, head_dim=HD,
                         ffn_hidden=H, qk_norm=True, rope_factor=8.0, rope_original_max_position_embeddings=16)
    save_weights(tmp_path / "scaled", 0, scaled, Llama(scaled, seed=0).state_dict())
    _refused(capsys, ["convert", str(tmp_path / "scaled"), str(tmp_path / "s.gguf"), "--format", "gguf"],
             tmp_path / "s.gguf", "which llama.cpp applies in llama models only, not qwen3")
