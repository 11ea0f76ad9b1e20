"""What cluster routers read from a running ``gpullama-serve``: the gauges under the names of the Gateway API
inference extension's model-server protocol (parsed with prometheus_client's own parser), and the KV-cache events
of ``--kv-events-config`` (decoded with vLLM's message types)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.test_kv_events import DECODER, BlockStored, subscriber
from tests.server.conftest import free_port, start_server, stop_server
from tests.server.helpers import API_KEY

BLOCK = 16


@pytest.fixture(scope="module")
def events_server(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    """A server of the tiny model publishing KV events on a free loopback port."""
    port = free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}
    srv = start_server(tiny_model("llama").path, tmp_path_factory.mktemp("events") / "server.log",
                       ["--kv-events-config", json.dumps(config), "--log-stats-interval", "0"])
    yield srv, f"tcp://127.0.0.1:{port}"
    stop_server(srv)


def _samples(text: str) -> dict[str, list]:
    """Samples by metric name, as Prometheus reads the exposition."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def _value(samples: dict[str, list], name: str) -> float:
    (sample,) = samples[name]
    return sample.value


def test_protocol_gauges_and_kv_events(events_server) -> None:
    srv, endpoint = events_server
    sub = subscriber(endpoint)  # joined before any request
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=srv.base_url, timeout=60, headers=headers) as http:
        idle = _samples(http.get("/metrics").text)
        assert _value(idle, "vllm:num_requests_waiting") == 0
        assert _value(idle, "vllm:num_requests_running") == 0
        assert _value(idle, "vllm:kv_cache_usage_perc") == 0
        (info,) = idle["vllm:cache_config_info"]
        assert info.labels["block_size"] == str(BLOCK)
        assert int(info.labels["num_gpu_blocks"]) == _value(idle, "gpullama_kv_blocks_total") > 0

        prompt = [700] + [(7 * i) % 600 + 3 for i in range(3 * BLOCK + 4)]
        body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            busy = _samples(http.get("/metrics").text)
            assert _value(busy, "vllm:num_requests_running") == 1
            usage = _value(busy, "vllm:kv_cache_usage_perc")
            assert usage == _value(busy, "gpullama_kv_cache_usage_ratio") > 0
            assert _value(busy, "vllm:gpu_cache_usage_perc") == usage
            for _ in lines:
                pass

    stored: list[BlockStored] = []
    deadline = time.monotonic() + 60
    while sum(len(e.block_hashes) for e in stored) < 3:
        assert time.monotonic() < deadline, f"events so far: {stored}"
        if sub.poll(100):
            _, _, payload = sub.recv_multipart()
            stored += [e for e in DECODER.decode(payload).events if isinstance(e, BlockStored)]
    sub.close(linger=0)
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids[: 3 * BLOCK] == prompt[: 3 * BLOCK]


def test_a_bad_kv_events_config_is_refused_before_loading(tmp_path: Path) -> None:
    from gpullama.server.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "port": 5557}'])
