"""The public LLM API on the real SmolLM2-135M-Instruct: answers, parity with transformers, sampling and streaming."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpullama import LLM, Completion, SamplingParams

PROMPT = "The capital of France is"
FRANCE = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
GERMANY = [{"role": "user", "content": "What is the capital of Germany? Answer with one word."}]
EMOJI_PROMPT = "Emoji list: 😀 😃 😄 😁 😆"
STORY = "Once upon a time"
GREEDY_TOKENS = 16
REPLACEMENT = "\ufffd"


def greedy(max_tokens: int = GREEDY_TOKENS, **kwargs) -> SamplingParams:
    """Greedy decoding of at most `max_tokens` tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def france_text(default_llm: LLM) -> Completion:
    """Greedy continuation of PROMPT (float32)."""
    return default_llm.generate(PROMPT, greedy())[0]


@pytest.fixture(scope="module")
def france_chat(default_llm: LLM) -> Completion:
    """Greedy answer to the FRANCE conversation (float32)."""
    return default_llm.chat(FRANCE, greedy())[0]


# -- answers -----------------------------------------------------------------------------------------------
def test_chat_answers_paris(france_chat: Completion) -> None:
    assert "Paris" in france_chat.text
    assert france_chat.finish_reason == "stop"


def test_generate_continues_with_paris(france_text: Completion) -> None:
    assert france_text.text.lstrip().startswith("Paris"), france_text.text
    assert france_text.prompt_token_ids == [504, 3575, 282, 4649, 314]  # SmolLM2's ids: no BOS for plain text


def test_bfloat16_also_says_paris(short_bf16_llm: LLM) -> None:
    assert short_bf16_llm.dtype == torch.bfloat16
    text = short_bf16_llm.generate(PROMPT, greedy(4))[0].text
    assert text.lstrip().startswith("Paris"), text
    answer = short_bf16_llm.chat(FRANCE, greedy(12))[0].text
    assert "Paris" in answer, answer


def test_logits_match_transformers_on_the_same_gguf(default_llm: LLM, hf_default_model) -> None:
    ids = default_llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    assert 10 <= len(ids) <= 24
    got = default_llm.logits(ids)
    with torch.no_grad():
        want = hf_default_model(torch.tensor([ids])).logits[0].float()
    assert got.dtype == torch.float32 and got.shape == want.shape == (len(ids), default_llm.config.vocab_size)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-4, f"max relative error {rel:.3g}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# -- sampling ---------------------------------------------------------------------------------------------
def test_same_seed_repeats_and_another_seed_differs(default_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    first = default_llm.generate(STORY, params)[0]
    again = default_llm.generate(STORY, SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True))[0]
    other = default_llm.generate(STORY, SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True))[0]
    assert again.token_ids == first.token_ids and again.text == first.text
    assert other.token_ids != first.token_ids  # 16 draws at temperature 1: a full collision is vanishingly rare


def test_stop_string_cuts_the_text_and_is_not_included(default_llm: LLM, france_text: Completion) -> None:
    text = france_text.text
    # a 4-character stop string starting mid-text, at its first occurrence
    start = next(i for i in range(len(text) // 2, len(text) - 4) if text.find(text[i : i + 4]) == i)
    stop = text[start : start + 4]
    cut = default_llm.generate(PROMPT, greedy(stop=[stop, "never-in-this-text"]))[0]
    assert cut.text == text[:start], (stop, cut.text)
    assert stop not in cut.text
    assert cut.finish_reason == "stop"
    assert cut.token_ids == france_text.token_ids[: len(cut.token_ids)]


def test_max_tokens_gives_length_and_exactly_that_many_tokens(default_llm: LLM, france_text: Completion) -> None:
    assert france_text.finish_reason == "length" and len(france_text.token_ids) == GREEDY_TOKENS
    short = default_llm.generate(PROMPT, greedy(5))[0]
    assert short.finish_reason == "length"
    assert len(short.token_ids) == 5
    assert short.token_ids == france_text.token_ids[:5]


def test_ignore_eos_runs_past_the_end_of_turn(default_llm: LLM, france_chat: Completion) -> None:
    eos = set(default_llm.tokenizer.eos_token_ids)
    assert france_chat.token_ids[-1] in eos  # the answer ended on an end-of-turn token...
    end = default_llm.tokenizer.decode(france_chat.token_ids[-1:], skip_special_tokens=False)
    assert end and end not in france_chat.text  # ...whose text is not shown
    n = len(france_chat.token_ids)
    longer = default_llm.chat(FRANCE, greedy(n + 3, ignore_eos=True))[0]
    assert longer.finish_reason == "length"
    assert len(longer.token_ids) == n + 3
    assert longer.token_ids[:n] == france_chat.token_ids


def test_logprobs_are_the_log_softmax_of_the_logits(default_llm: LLM) -> None:
    top_n = 5
    out = default_llm.generate(STORY, SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=top_n))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    ids = out.prompt_token_ids + out.token_ids
    n_prompt = len(out.prompt_token_ids)
    reference = torch.log_softmax(default_llm.logits(ids[:-1]).double(), dim=-1)  # row p predicts token p+1
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = reference[n_prompt - 1 + i]
        assert entry.token_id == token
        assert entry.logprob <= 0
        assert abs(entry.logprob - row[token].item()) < 1e-4, (i, entry.logprob, row[token].item())
        assert len(entry.top) == top_n
        values = [t.logprob for t in entry.top]
        assert all(v <= 0 for v in values) and values == sorted(values, reverse=True)
        best = row.topk(top_n).values.tolist()
        assert max(abs(a - b) for a, b in zip(values, best)) < 1e-4, (i, values, best)
        for t in entry.top:
            assert abs(t.logprob - row[t.token_id].item()) < 1e-4


def test_logits_of_a_prefix_are_the_first_rows(default_llm: LLM, france_text: Completion) -> None:
    ids = france_text.prompt_token_ids + france_text.token_ids[:6]
    full = default_llm.logits(ids)
    prefix = default_llm.logits(ids[:4])
    assert full.shape == (len(ids), default_llm.config.vocab_size) and full.dtype == torch.float32
    assert ((prefix - full[:4]).abs().max() / full.abs().max()).item() < 1e-5
    # greedy generation picked the argmax of these very logits
    assert full[len(france_text.prompt_token_ids) - 1 :].argmax(-1).tolist()[:6] == france_text.token_ids[:6]


# -- streaming --------------------------------------------------------------------------------------------
def test_stream_concatenates_to_the_generated_text(default_llm: LLM, france_text: Completion) -> None:
    deltas = list(default_llm.stream(PROMPT, greedy()))
    assert len(deltas) > 1 and all(isinstance(d, str) and d for d in deltas)
    assert "".join(deltas) == france_text.text


def test_stream_of_a_conversation_matches_chat(default_llm: LLM, france_chat: Completion) -> None:
    assert "".join(default_llm.stream(FRANCE, greedy())) == france_chat.text


def test_stream_never_splits_a_utf8_character(default_llm: LLM) -> None:
    params = greedy(12)
    whole = default_llm.generate(EMOJI_PROMPT, params)[0]
    decode = default_llm.tokenizer.decode
    split = [t for t in whole.token_ids if REPLACEMENT in decode([t])]
    assert split, f"the output {whole.text!r} has no character spread over several tokens: pick another prompt"
    assert REPLACEMENT not in whole.text and any(len(ch.encode()) >= 3 for ch in whole.text)
    deltas = list(default_llm.stream(EMOJI_PROMPT, params))
    assert "".join(deltas) == whole.text
    assert not [d for d in deltas if REPLACEMENT in d], deltas


# -- batches ----------------------------------------------------------------------------------------------
def test_generate_with_a_list_returns_one_completion_per_prompt_in_order(default_llm: LLM) -> None:
    prompts = ["The capital of Germany is", PROMPT, "1, 2, 3, 4,"]
    outs = default_llm.generate(prompts, greedy(3))
    assert len(outs) == 3 and all(isinstance(c, Completion) for c in outs)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == default_llm.tokenizer.encode(prompt, add_special_tokens=True)
        assert len(out.token_ids) == 3
    assert "Berlin" in outs[0].text and "Paris" in outs[1].text and "5" in outs[2].text


def test_chat_with_a_list_of_conversations_returns_one_completion_each(
    default_llm: LLM, france_chat: Completion
) -> None:
    outs = default_llm.chat([GERMANY, FRANCE], greedy())
    assert len(outs) == 2 and all(isinstance(c, Completion) for c in outs)
    tok = default_llm.tokenizer
    for conversation, out in zip([GERMANY, FRANCE], outs):
        assert out.prompt_token_ids == tok.encode(tok.apply_chat_template(conversation), add_special_tokens=False)
    assert "Berlin" in outs[0].text
    assert "Paris" in outs[1].text


def test_n_samples_per_prompt_as_vllm(default_llm: LLM) -> None:
    """SamplingParams(n=3): three samples per prompt in Completion.outputs; sample i of seed s is the request of
    seed s + i run alone, so the samples differ from each other and repeat."""
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    prompts = [PROMPT, STORY]
    outs = default_llm.generate(prompts, params)
    assert len(outs) == 2
    for prompt, out in zip(prompts, outs):
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert len({tuple(o.token_ids) for o in out.outputs}) == 3, [o.text for o in out.outputs]
        assert (out.text, out.token_ids) == (out.outputs[0].text, out.outputs[0].token_ids)
        for i, sample in enumerate(out.outputs):
            alone = default_llm.generate(prompt, dataclasses.replace(params, n=1, seed=7 + i))[0]
            assert sample.token_ids == alone.token_ids and sample.text == alone.text
            assert sample.finish_reason == "length" and len(sample.token_ids) == 10
    chats = default_llm.chat(FRANCE, greedy(4, n=2))
    assert len(chats) == 1 and len(chats[0].outputs) == 2
    assert chats[0].outputs[0].token_ids == chats[0].outputs[1].token_ids  # greedy: the same twice
    with pytest.raises(ValueError, match="n must be 1"):
        list(default_llm.stream(PROMPT, params))
