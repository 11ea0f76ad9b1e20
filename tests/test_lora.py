"""LoRA adapters as llama.cpp reads them: a tiny random transformers Llama (SmolLM2's tokenizer) with two `peft`
adapters of random non-zero B, the base converted by llama.cpp's ``convert_hf_to_gguf.py`` and the adapters by its
``convert_lora_to_gguf.py``. The references: transformers with the peft adapter applied, and peft's
``merge_and_unload`` model converted on its own; then two adapters and the base in one batch against each alone."""

from __future__ import annotations

import copy
import shutil
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from gpullama import LLM, LoRARequest, SamplingParams
from gpullama.gguf_file import ModelFileError
from gpullama.kernels import cpu_native
from gpullama.lora import prepare_lora, read_lora
from gpullama.ops import CpuOps
from gpullama.quants import QTensor
from tests.fixtures.llamacpp_source import convert_hf_to_gguf, convert_lora_to_gguf
from tests.test_converted_models import smollm2_tokenizer
from tests.test_cpu_fast_path import assert_close_and_same_top1
from tests.test_model_parity import assert_close, hf_logits, token_ids

peft = pytest.importorskip("peft")

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)
ADAPTERS = {
    # every dense matrix, the embedding table and the output head; alpha != rank
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj", "embed_tokens", "lm_head"]),
    # peft's usual choice for Llama, another rank and alpha
    "qv": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
}
needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_path: Path):
    """The base model's folder and GGUFs (float32, and q8_0 for the fast path), each adapter's peft model, its GGUF
    and the GGUF of its merged weights."""
    tokenizer = smollm2_tokenizer(default_model_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    base_dir.mkdir()
    for f in tokenizer.iterdir():
        shutil.copy(f, base_dir / f.name)
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id or 0)
    base = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.08) + (1.0 if "norm" in name else 0))
    base.save_pretrained(base_dir)
    out = {"base_dir": base_dir, "base": convert_hf_to_gguf(base_dir, root / "base-f32.gguf"),
           "base_q8": convert_hf_to_gguf(base_dir, root / "base-q8_0.gguf", "--outtype", "q8_0")}
    for seed, (name, settings) in enumerate(ADAPTERS.items()):
        fresh = AutoModelForCausalLM.from_pretrained(base_dir).float().eval()
        model = peft.get_peft_model(fresh, peft.LoraConfig(**settings)).eval()
        gen = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():  # random A and (non-zero) B, large enough to move the logits
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        adapter_dir = root / f"adapter-{name}"
        model.save_pretrained(adapter_dir, save_embedding_layers=False)
        gguf = convert_lora_to_gguf(adapter_dir, base_dir, root / f"lora-{name}.gguf")
        merged_gguf = None
        if name == "all":  # the merged weights of the adapter that changes every matrix (a converter run less)
            merged_dir = root / f"merged-{name}"
            copy.deepcopy(model).merge_and_unload().save_pretrained(merged_dir)
            for f in tokenizer.iterdir():
                shutil.copy(f, merged_dir / f.name)
            merged_gguf = convert_hf_to_gguf(merged_dir, root / f"merged-{name}.gguf")
        out[name] = (model, gguf, merged_gguf)
    return out


@pytest.fixture(scope="module")
def exact(tiny):
    return LLM(str(tiny["base"]), device="cpu", dtype="float32", lora={n: str(tiny[n][1]) for n in ADAPTERS})


def test_file_is_read_as_llamacpp_writes_it(tiny) -> None:
    """The converter's metadata and pairs: alpha, A [r, K], B [N, r], token_embd's A transposed."""
    lora = read_lora(tiny["all"][1])
    assert lora.architecture == "llama" and lora.alpha == 16
    a, b = lora.pairs["blk.0.attn_q.weight"]
    assert a.shape == (8, 64) and b.shape == (64, 8)
    a, b = lora.pairs["token_embd.weight"]
    assert a.shape[1] == 8 and b.shape == (64, 8)
    assert "output.weight" in lora.pairs and "blk.2.ffn_down.weight" in lora.pairs


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_equal_transformers_with_peft_and_the_merged_model(tiny, exact, name: str) -> None:
    """The exact path with the adapter: within 1e-3 of the largest logit of transformers + peft, and of the merged
    model's GGUF; without it, the base's."""
    model, _, merged_path = tiny[name]
    ids = token_ids(exact.config.vocab_size, n=24)
    want = hf_logits(model, ids)
    got = exact.logits(ids, lora=name)
    assert_close(got, want, f"{name} vs transformers+peft", tolerance=1e-3)
    if merged_path is not None:
        merged = LLM(str(merged_path), device="cpu", dtype="float32")
        assert_close(got, merged.logits(ids), f"{name} vs merged", tolerance=1e-3)
    with model.disable_adapter():
        assert_close(exact.logits(ids), hf_logits(model, ids), "base", tolerance=1e-3)
    assert (got - exact.logits(ids)).abs().max() > 0.05 * want.abs().max()  # the adapter does change the logits
    scaled = [m for m in model.modules() if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling]
    for m in scaled:  # llama.cpp's scale multiplies alpha / r: peft's scaling
        m.scaling["default"] *= 0.5
    try:
        want_half = hf_logits(model, ids)
    finally:
        for m in scaled:
            m.scaling["default"] *= 2
    assert_close(exact.logits(ids, lora=LoRARequest(name, scale=0.5)), want_half, f"{name} at scale 0.5",
                 tolerance=1e-3)


def test_embeddings_under_an_adapter_equal_the_merged_models(tiny, exact) -> None:
    """`embed(..., lora=)` runs the adapter as generation does: the vectors equal those of the merged model's GGUF
    (peft's merged weights, written by llama.cpp's converter) within float32 rounding, and differ from the base's."""
    prompts = [token_ids(exact.config.vocab_size, n=n, seed=n) for n in (5, 17)]
    got = torch.tensor([e.embedding for e in exact.embed(prompts, lora="all")])
    merged = LLM(str(tiny["all"][2]), device="cpu", dtype="float32")
    want = torch.tensor([e.embedding for e in merged.embed(prompts)])
    base = torch.tensor([e.embedding for e in exact.embed(prompts)])
    assert (got - want).abs().max() < 1e-4
    assert (got - base).abs().max() > 1e-2  # the adapter does change them


def _mixed_batch(llm: LLM, prompts: list[list[int]], loras: list) -> list[list[int]]:
    """Greedy tokens of each prompt with its adapter (None: the base), all in one engine batch."""
    engine = llm.engine
    seqs = []
    for i, (ids, lora) in enumerate(zip(prompts, loras)):
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora=llm._lora_pairs(lora))
        seqs.append(engine.add_request(f"mixed-{i}", ids, params))
    while engine.has_work():
        engine.step()
    return [s.output_token_ids for s in seqs]


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
def test_two_adapters_and_the_base_in_one_batch_equal_each_alone(tiny, exact, fast: bool) -> None:
    """Six prompts, each adapter and the base twice (a shared prefix among them, so the prefix cache is asked to
    serve KV across adapters), in one batch: each gets its solo greedy tokens. The fast path: the base in q8_0 (its
    weights stay quantized), the layers in one C call with the adapters added; its logits with an adapter within
    its tolerance of the exact path's on the same file."""
    if fast:
        with mock.patch("gpullama.engine.model_spec.quantized_cpu_path", return_value=True):
            llm = LLM(str(tiny["base_q8"]), device="cpu", lora={n: str(tiny[n][1]) for n in ADAPTERS})
        assert isinstance(llm.model.ops, CpuOps)
        runner = llm.engine.runner
        assert llm.model.ops.layer_stack(llm.model, runner.k_caches, runner.v_caches) is not None
        reference = LLM(str(tiny["base_q8"]), device="cpu", dtype="float32", lora={n: str(tiny[n][1]) for n in ADAPTERS})
        ids = token_ids(llm.config.vocab_size, n=24)
        for name in ADAPTERS:
            assert_close_and_same_top1(llm.logits(ids, lora=name), reference.logits(ids, lora=name), f"fast {name}")
    else:
        llm = exact
    vocab = llm.config.vocab_size
    shared = token_ids(vocab, n=40, seed=7)
    prompts = [shared + token_ids(vocab, n=3 + i, seed=i) for i in range(3)] + [shared] * 3
    loras = ["all", "qv", None, None, "qv", "all"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = [llm.generate([p], params, lora=lora)[0].token_ids for p, lora in zip(prompts, loras)]
    assert len({tuple(t) for t in alone[3:]}) == 3, "the adapters should change the greedy tokens of one prompt"
    assert _mixed_batch(llm, prompts, loras) == alone


def test_prefix_cache_is_keyed_by_adapter(exact) -> None:
    """A prompt run under one adapter leaves cached blocks no other adapter (nor the base) is served."""
    ids = token_ids(exact.config.vocab_size, n=70, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = exact.generate([ids], params, lora="all")[0]
    assert first.num_cached_tokens == 0
    assert exact.generate([ids], params, lora="qv")[0].num_cached_tokens == 0
    assert exact.generate([ids], params)[0].num_cached_tokens == 0
    assert exact.generate([ids], params, lora="all")[0].num_cached_tokens > 0
    assert exact.generate([ids], params, lora={"all": 0.5})[0].num_cached_tokens == 0  # another scale: other KV


def test_speculative_decoding_with_an_adapter_gives_plain_decoding(tiny, exact) -> None:
    """n-gram drafts are rows of their sequence: verified with the adapter, the tokens are plain greedy decoding's."""
    spec = LLM(str(tiny["base"]), device="cpu", dtype="float32", lora={"all": str(tiny["all"][1])},
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    ids = token_ids(exact.config.vocab_size, n=6, seed=5) * 4
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert spec.generate([ids], params, lora="all")[0].token_ids == exact.generate([ids], params, lora="all")[0].token_ids


def test_mismatched_adapters_are_refused(tiny, exact) -> None:
    """A model file is not an adapter; an adapter of other shapes names the tensor and both shapes; an unknown name
    or id is refused when the request is made."""
    with pytest.raises(ModelFileError, match="not a LoRA adapter"):
        read_lora(tiny["base"])
    other = exact
    lora = read_lora(tiny["all"][1])
    a, b = lora.pairs["blk.0.attn_q.weight"]
    lora.pairs["blk.0.attn_q.weight"] = (QTensor(a.data[:, :32].contiguous(), a.qtype, (8, 32)), b)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*\(64, 64\).*wrong base model"):
        prepare_lora(other.model, lora, "bad")
    lora.architecture = "qwen2"
    with pytest.raises(ValueError, match="made for architecture 'qwen2'"):
        prepare_lora(other.model, lora, "bad")
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        other.generate(["hi"], lora="nope")
    with pytest.raises(ValueError, match="LoRA adapter id 7 is not loaded"):
        other.generate(["hi"], SamplingParams(lora=[(7, 1.0)]))


def openai_model(client, model: str) -> dict:
    """An OpenAI completion of two tokens by `model`, as JSON."""
    answer = client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_server_flags_field_and_model_names_reach_the_engine(tiny, exact) -> None:
    """gpullama-serve's adapters: `--lora NAME=PATH` is picked by a request's `model` (vLLM), `--lora FILE` applies
    to every request without a `lora` field (llama.cpp), llama.cpp's per-request `lora` field and POST
    /lora-adapters change that; each answer is the LLM's with the same adapters. Runtime loading is off without
    its flag, and on with it."""
    from starlette.testclient import TestClient

    from gpullama.engine.args import EngineArgs
    from gpullama.server.adapters import parse_lora
    from gpullama.server.app import create_app
    from gpullama.server.state import ServerConfig, ServerState

    config = ServerConfig(engine=EngineArgs(model=str(tiny["base"]), device="cpu", dtype="float32"),
                          lora=parse_lora(f"sql={tiny['all'][1]}") + parse_lora(str(tiny["qv"][1])),
                          lora_runtime_updating=True, log_stats_interval=0)
    ids = token_ids(exact.config.vocab_size, n=12, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def want(lora) -> list[int]:
        return exact.generate([ids], params, lora=lora)[0].token_ids

    with TestClient(create_app(config, ServerState(config)), base_url="http://127.0.0.1:8080") as client:
        while client.get("/health").status_code == 503:  # loading (a failed load answers 500 and fails below)
            time.sleep(0.1)

        def completion(**extra) -> list[int]:
            body = {"prompt": ids, "n_predict": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}
            answer = client.post("/completion", json=body | extra)
            assert answer.status_code == 200, answer.text
            return answer.json()["tokens"]

        listed = client.get("/lora-adapters").json()
        assert [(a["id"], a["name"], a["scale"]) for a in listed] == [(0, "sql", 0.0), (1, "lora-qv", 1.0)]
        assert completion() == want("qv")  # llama.cpp: a --lora FILE adapter applies to every request
        assert completion(lora=[{"id": 0, "scale": 1.0}]) == want("all")  # the field: only the adapters it lists
        assert completion(lora=[{"id": 1, "scale": 0.5}]) == want({"qv": 0.5})
        assert completion(model="sql") == want("all")  # vLLM: the adapter's name as the model
        openai = client.post("/v1/completions", json={"model": "sql", "prompt": ids, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True})
        assert openai.status_code == 200, openai.text
        assert openai.json()["choices"][0]["text"] == exact.tokenizer.decode(want("all"))
        assert openai.json()["model"] == "sql"  # vLLM: the answer names the adapter
        chat = client.post("/v1/chat/completions", json={"model": "sql", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == "sql"
        native = client.post("/completion", json={"model": "sql", "prompt": ids, "n_predict": 2})
        assert native.json()["model"] == "sql"
        ollama = client.post("/api/generate", json={"model": "sql", "prompt": "Hi", "stream": False,
                                                    "options": {"num_predict": 2}})
        assert ollama.status_code == 200 and ollama.json()["model"] == "sql"
        anthropic = client.post("/v1/messages", json={"model": "sql", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        assert anthropic.status_code == 200 and anthropic.json()["model"] == "sql"
        responses = client.post("/v1/responses", json={"model": "sql", "input": "Hi", "max_output_tokens": 2})
        assert responses.status_code == 200 and responses.json()["model"] == "sql"

        def vectors(answer) -> torch.Tensor:
            assert answer.status_code == 200, answer.text
            return torch.tensor([d["embedding"] for d in answer.json()["data"]])

        def embedded(lora) -> torch.Tensor:
            return torch.tensor([e.embedding for e in exact.embed([ids], lora=lora)])

        named = client.post("/v1/embeddings", json={"model": "sql", "input": [ids]})  # vLLM: the adapter by name
        assert torch.allclose(vectors(named), embedded("all"), atol=1e-5) and named.json()["model"] == "sql"
        plain = client.post("/v1/embeddings", json={"input": [ids]})  # llama.cpp: the server's adapters
        assert torch.allclose(vectors(plain), embedded("qv"), atol=1e-5)
        olla = client.post("/api/embed", json={"model": "sql", "input": "Hi"})
        assert olla.status_code == 200 and olla.json()["model"] == "sql"
        base_name = tiny["base"].stem
        assert openai_model(client, base_name)["model"] == base_name  # the base model by its own name
        cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert cards["sql"]["parent"] == base_name and cards["sql"]["root"] == str(tiny["all"][1])  # vLLM's card
        assert "parent" not in cards[base_name]
        assert client.post("/lora-adapters", json=[]).status_code == 200  # every global scale to 0
        assert completion() == want(None)
        bad = client.post("/completion", json={"prompt": ids, "lora": [{"id": 9, "scale": 1}]})
        assert bad.status_code == 400 and "LoRA adapter id 9 is not loaded" in bad.text
        assert client.post("/completion", json={"prompt": ids, "lora": "x"}).status_code == 400
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(tiny["all"][1])})
        assert loaded.status_code == 200, loaded.text
        assert completion(model="late") == want("all")
        # unloaded and loaded again, the model serves its adapters as they were: "late" (loaded at run time) and
        # every global scale at 0 (POST /lora-adapters above)
        assert client.post("/models/unload", json={"model": base_name}).json()["success"] is True
        assert completion(model="late") == want("all")  # this request loads the model again
        listed = client.get("/lora-adapters").json()
        assert [(a["name"], a["scale"]) for a in listed] == [("sql", 0.0), ("lora-qv", 0.0), ("late", 0.0)]
        assert completion() == want(None)
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        assert client.post("/completion", json={"prompt": ids, "model": "late"}).status_code == 404
