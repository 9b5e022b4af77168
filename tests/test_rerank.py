"""Rerank on a cross-encoder: a random-weight BertForSequenceClassification of cross-encoder/
ms-marco-MiniLM-L-6-v2's shape (6 layers, 384 wide, 12 heads, one label) scored against
sentence-transformers' CrossEncoder on the same folder, and the rerank routes' shape."""

from __future__ import annotations

import httpx
import pytest

from stratum.engine.config import EngineConfig
from stratum.engine.encoder import make_engine
from stratum.engine.sampling_params import SamplingParams
from tests.conftest import ServerProcess
from tests.encoders import make_bert_dir

QUERY = "How does a paged KV cache save memory?"
DOCS = ["Paged attention stores keys and values in fixed-size blocks, so no sequence reserves its whole context.",
        "The cat sat on the mat.", "Blocks are shared between requests with the same prefix.",
        "Rerankers score a query against each document.", "Bananas are rich in potassium."]


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory):
    return make_bert_dir(tmp_path_factory.mktemp("cross-encoder"), num_labels=1, hidden=384, layers=6, heads=12,
                         intermediate=1536, seed=3)


@pytest.fixture(scope="module")
def reference(cross_dir) -> list[float]:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(cross_dir), device="cpu").predict([(QUERY, d) for d in DOCS]).tolist()


def test_scores_match_sentence_transformers_cross_encoder(cross_dir, reference):
    engine = make_engine(EngineConfig(model=str(cross_dir)))
    info = engine.info()
    assert (info.tasks, info.pooling, info.embedding_size) == (("score",), "score", 1)
    pairs = [e.ids for e in engine.tokenizer.plain.encode_batch([(QUERY, d) for d in DOCS], add_special_tokens=True)]
    for i, ids in enumerate(pairs):
        engine.add_request(ids, SamplingParams(max_tokens=0), request_id=str(i), task="score")
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    ours = [outs[str(i)].embedding[0] for i in range(len(DOCS))]
    assert ours == pytest.approx(reference, abs=1e-5)
    # (random token-type embeddings: the document read as segment 0 would not match the reference)
    engine.add_request(pairs[0], SamplingParams(max_tokens=0), request_id="single", task="score")
    assert engine.step()[0].embedding[0] == ours[0]  # alone as in the batch, bit for bit
    with pytest.raises(Exception):
        engine.add_request(pairs[0], SamplingParams(max_tokens=0), task="embed")


@pytest.fixture(scope="module")
def rerank_server(cross_dir):
    server = ServerProcess(str(cross_dir), "--served-model-name", "reranker").wait_ready()
    yield server
    server.stop()


def test_rerank_routes_answer_in_the_shared_shape(rerank_server, reference):
    order = sorted(range(len(DOCS)), key=lambda i: -reference[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(rerank_server.url + path, json={"model": "reranker", "query": QUERY, "documents": DOCS,
                                                       "top_n": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]] == order[:3]
        assert [x["relevance_score"] for x in body["results"]] == pytest.approx([reference[i] for i in order[:3]],
                                                                                 abs=1e-5)
        assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in order[:3]]
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        assert "prefill_latency_us=" in r.headers["x-stratum-cost"]
    objects = httpx.post(rerank_server.url + "/v1/rerank", json={
        "query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False}).json()
    assert [x["index"] for x in objects["results"]] == order and "document" not in objects["results"][0]


def test_rerank_errors(rerank_server, tiny_server):
    url = rerank_server.url + "/v1/rerank"
    for body in ({"query": QUERY, "documents": []}, {"query": "", "documents": DOCS}, {"documents": DOCS},
                 {"query": QUERY, "documents": DOCS, "top_n": 0}, {"query": "word " * 600, "documents": DOCS}):
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    assert httpx.post(url, json={"model": "other", "query": QUERY, "documents": DOCS}).status_code == 404
    r = httpx.post(rerank_server.url + "/v1/embeddings", json={"model": "reranker", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
    r = httpx.post(tiny_server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and "does not support rerank" in r.json()["error"]["message"]
    assert httpx.get(rerank_server.url + "/health").json()["running"] == 0
