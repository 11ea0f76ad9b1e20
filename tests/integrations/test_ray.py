"""gpullama on Ray Serve, on a local Ray instance with 2 CPUs: two replicas of a tiny model behind Ray's HTTP proxy.
The official OpenAI client streams through the proxy and gets the library's own answer; a repeated prompt goes to
the replica that holds its prefix (its usage reports the cached tokens); a replica killed mid-stream is replaced
and the next requests succeed."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import ray
from ray import serve

from gpullama import LLM, SamplingParams
from gpullama.integrations.ray import ForwardedRequest, build_app
from tests.server.conftest import free_port

CHAT = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@pytest.fixture(scope="module")
def ray_app(tiny_model):
    """Ray (2 CPUs) with 2 replicas of the tiny Granite, one thread each; the proxy's base URL."""
    path = tiny_model("granite", "F32").path
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": str(path), "device": "cpu", "dtype": "float32", "threads": 1},
                            num_replicas=2), route_prefix="/")
        yield path, f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _replicas() -> list[str]:
    return sorted(name["name"] for name in ray.util.list_named_actors(all_namespaces=True)
                  if "GpullamaReplica" in name["name"])


def test_streams_through_the_proxy_with_prefix_affinity_and_survives_a_killed_replica(ray_app) -> None:
    path, base_url = ray_app
    one = LLM(str(path), device="cpu", dtype="float32")
    want = one.chat(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 2 and "".join(chunks) == want.text

    # the same prompt four times: the prefix router keeps it on the replica that cached its full blocks
    prompt = "The old lighthouse stood at the end of a narrow spit of rock, and for more than a century its lamp " \
        "had turned every night without fail; the keepers kept careful logs of the weather and the ships."
    full_blocks = (len(one.tokenizer.encode(prompt, add_special_tokens=True)) - 1) // 16 * 16
    assert full_blocks >= 32
    cached = [client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
              .usage.prompt_tokens_details.cached_tokens for _ in range(4)]
    assert cached == [0, full_blocks, full_blocks, full_blocks]

    before = _replicas()
    assert len(before) == 2
    outcome: list = []

    def long_stream() -> None:
        try:
            s = client.completions.create(model=model, prompt=prompt, max_tokens=150, temperature=0,
                                          extra_body={"ignore_eos": True}, stream=True)
            outcome.append(sum(1 for _ in s))
        except Exception as exc:  # noqa: BLE001 - the stream of the killed replica may end with an error
            outcome.append(exc)

    runner = threading.Thread(target=long_stream)
    runner.start()
    time.sleep(0.5)  # mid-stream
    for name in before:  # the replica that holds the prompt's prefix: the one serving the stream
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        break
    runner.join(timeout=60)
    assert outcome, "the stream of a killed replica hung"
    deadline = time.monotonic() + 90
    while True:  # the controller starts a replacement
        now = _replicas()
        status = serve.status().applications["default"].deployments["GpullamaReplica"].status
        if len(now) == 2 and now != before and status == "HEALTHY":
            break
        assert time.monotonic() < deadline, (now, status)
        time.sleep(0.5)
    for _ in range(4):
        out = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=12)
        assert out.choices[0].message.content == want.text


def test_routing_text_is_what_the_prefix_router_reads() -> None:
    assert ForwardedRequest.routing_text(b'{"messages": [{"role": "user", "content": "hi"}]}') == \
        ("messages", [{"role": "user", "content": "hi"}])
    assert ForwardedRequest.routing_text(b'{"prompt": "Once"}') == ("prompt", "Once")
    assert ForwardedRequest.routing_text(b'{"prompt": [1, 2, 3]}') is None  # token ids: no text to match
    assert ForwardedRequest.routing_text(b'{"prompt": ""}') is None
    assert ForwardedRequest.routing_text(b"not json") is None
    assert ForwardedRequest.routing_text(b"") is None
