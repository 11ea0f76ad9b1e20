"""gpullama on Ray Serve, on a local Ray instance with 2 CPUs: two replicas of a tiny model behind Ray's HTTP proxy.
The official OpenAI client streams through the proxy and gets the library's own answer; a repeated prompt goes to
the replica that holds its prefix (its usage reports the cached tokens); a replica killed mid-stream is replaced
and the next requests succeed."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import ray
from ray import serve

from gpullama import LLM, SamplingParams
from gpullama.integrations.ray import ForwardedRequest, build_app
from tests.server.conftest import free_port

CHAT = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
# How long the fixture and the test wait for what Ray starts (the proxy, a replacement replica): a ceiling for a
# busy machine, not a pause; each wait ends as soon as its condition holds.
STARTUP_DEADLINE_S = 300
# Ray Serve's controller kills its HTTP proxy, and starts another, when the proxy's ready check has timed out 3 times
# in a row; each check waits RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, 5 s by default (ray-project/ray#39716). On a busy
# machine the proxy's start-up (its imports, uvicorn) outlasts that (31 s beside two busy loops on 2 cores): the
# proxy that serve.start waits on is killed and serve.start raises ActorDiedError. The controller reads the knob
# from its environment, which it inherits from the processes ray.init starts.
PROXY_READY_CHECK_TIMEOUT_S = 60


def _start_serve(port: int) -> None:
    """`serve.start`, once more if the first gave up on the proxy. serve.start waits for the proxy at most Ray's
    fixed HTTP_PROXY_TIMEOUT (60 s, no knob), and raises ActorDiedError if the proxy it waits on was replaced
    anyway; in both cases the controller is up and keeps starting the proxy, so a second serve.start connects to it
    (the caller then waits for the proxy's /-/healthz)."""
    options = {"http_options": {"host": "127.0.0.1", "port": port}}
    try:
        serve.start(**options)
    except (TimeoutError, ray.exceptions.RayActorError):
        serve.start(**options)


def _wait_for_proxy(base_url: str) -> None:
    """Until Ray's HTTP proxy answers its own health check (it routes the app from then on)."""
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while True:
        try:
            answer = httpx.get(f"{base_url}/-/healthz", timeout=10)
            if answer.status_code == 200:
                return
            seen = f"{answer.status_code} {answer.text[:200]}"
        except httpx.TransportError as exc:
            seen = repr(exc)
        assert time.monotonic() < deadline, f"Ray's proxy not healthy after {STARTUP_DEADLINE_S}s: {seen}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_app(tiny_model):
    """Ray (2 CPUs) with 2 replicas of the tiny Granite, one thread each; the proxy's base URL."""
    path = tiny_model("granite", "F32").path
    port = free_port()
    with pytest.MonkeyPatch.context() as env:  # for Ray's processes, which keep the environment they start with
        env.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_CHECK_TIMEOUT_S))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        _start_serve(port)
        serve.run(build_app({"model": str(path), "device": "cpu", "dtype": "float32", "threads": 1},
                            num_replicas=2), route_prefix="/")
        _wait_for_proxy(f"http://127.0.0.1:{port}")
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
    streaming = threading.Event()

    def long_stream() -> None:
        try:
            s = client.completions.create(model=model, prompt=prompt, max_tokens=150, temperature=0,
                                          extra_body={"ignore_eos": True}, stream=True)
            count = 0
            for _ in s:
                count += 1
                streaming.set()
            outcome.append(count)
        except Exception as exc:  # noqa: BLE001 - the stream of the killed replica may end with an error
            outcome.append(exc)
        finally:
            streaming.set()

    runner = threading.Thread(target=long_stream)
    runner.start()
    assert streaming.wait(timeout=60), "the long stream sent nothing"  # mid-stream: its first chunk has come
    for name in before:  # the replica that holds the prompt's prefix: the one serving the stream
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        break
    runner.join(timeout=60)
    assert outcome, "the stream of a killed replica hung"
    deadline = time.monotonic() + STARTUP_DEADLINE_S
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
